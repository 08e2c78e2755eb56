"""The inference engine: `Engine(EngineConfig(model=...)).generate(requests)` yields Results."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.request import Request, RequestTimes, Result, SamplingParams

if TYPE_CHECKING:
    from batchinfer.engine.engine import Engine


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it only when asked for.
    if name == "Engine":
        from batchinfer.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'batchinfer.engine' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "Request", "RequestTimes", "Result", "SamplingParams"]
