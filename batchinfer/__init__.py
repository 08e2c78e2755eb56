"""batchinfer: offline, high-throughput batch document processing with LLMs.

`batchinfer.run(job)` runs a batch job (a YAML path, a dict or a JobSpec) and returns its summary;
it is imported lazily so that `import batchinfer` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["run", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from batchinfer.run import run

        return run
    raise AttributeError(f"module 'batchinfer' has no attribute {name!r}")
