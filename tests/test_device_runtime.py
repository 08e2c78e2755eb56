"""engine/device_runtime.py: the GPU's runtime started on a thread ahead of the engine."""

from __future__ import annotations

import pytest
import torch

from batchinfer.engine.device_runtime import start_device_runtime


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda", "cuda:0"])
def test_nothing_starts_without_a_cuda_device(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert start_device_runtime(device) is None


@pytest.mark.gpu
def test_the_runtime_starts_on_a_thread_that_ends():
    thread = start_device_runtime("auto")
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive() and torch.cuda.is_initialized()
