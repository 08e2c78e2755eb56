"""A GPU's runtime started on a thread, while the caller does the rest of its start-up.

Creating the CUDA context and the first cuBLAS handle takes 0.4-0.5 s on an H100 host, and both let
go of the GIL while they run (`scripts/cuda_init_probe.py`, BENCHMARKS.md). Left to the model load,
they come after the job's start-up work that holds the GIL (the engine's imports, the tokenizer load,
the grammar's tokenizer tables); started on a thread first, they run beside it. So does the hash of
Triton's compiler cache key, which the first kernel launch needs.
"""

from __future__ import annotations

import logging
import threading

import torch

from batchinfer.kernels._util import live_thread, warm_compile_key

log = logging.getLogger(__name__)

RUNTIME_THREAD = "device-runtime"


def start_device_runtime(device: str) -> threading.Thread | None:
    """Start `device`'s CUDA context and cuBLAS handle on a daemon thread; returns it (None: not a CUDA
    device, or none is available). A failure is only logged: the engine's own start reports it.
    Triton's compiler cache key (kernels/_util.warm_compile_key) starts hashing on a thread too: the
    engine's first kernel launch waits for it.

    Idempotent: while a start is running, it returns that thread (the CLI starts it as soon as the
    job is read, the local executor again in case it was not: job/executors/__init__.start_ahead)."""
    running = live_thread(RUNTIME_THREAD)
    if running is not None:
        return running
    if device == "auto":
        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda")
    else:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None

    def run() -> None:
        try:
            with torch.cuda.device(dev):
                a = torch.ones(64, 64, device=dev, dtype=torch.bfloat16)
                (a @ a).sum().item()  # the cuBLAS handle, then back to the pool when this thread ends
        except Exception as e:  # noqa: BLE001
            log.debug("starting %s's runtime ahead failed: %s", dev, e)

    thread = threading.Thread(target=run, name=RUNTIME_THREAD, daemon=True)
    thread.start()
    warm_compile_key()
    return thread
