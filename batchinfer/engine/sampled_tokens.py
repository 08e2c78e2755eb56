"""One step's sampled tokens on their way to the host (SampledTokens).

The engine reads a step's tokens while later device work is already queued behind it (the plain
loop's next forward, or the other verify lane's step): the copy to pinned host memory and a CUDA
event after it let the host wait for those tokens only.
"""

from __future__ import annotations

import torch

from batchinfer.engine.logprobs import StepLogprobs


class SampledTokens:
    """One step's sampled tokens: kept on the device (the next step gathers its input ids from
    `tensor`) and copied, without blocking the host, into pinned host memory; `tolist()` waits for
    that copy only (a CUDA event), not for work launched after it."""

    def __init__(self, device_tokens: torch.Tensor, logprobs: StepLogprobs | None = None) -> None:
        self.tensor = device_tokens
        self.event: torch.cuda.Event | None = None  # a timing event: it also ends the step's timeline
        # the rows' logprobs (engine/logprobs.py), when some row asked: copied with the tokens, read after tolist()
        self.logprobs = logprobs.to_host_async() if logprobs is not None else None
        if device_tokens.device.type == "cuda":
            self._host = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            self._host.copy_(device_tokens, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self._host = device_tokens

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self._host.tolist()
