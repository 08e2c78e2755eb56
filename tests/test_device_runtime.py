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


def test_the_compile_key_is_hashed_once_by_one_thread_that_callers_share(monkeypatch):
    """warm_compile_key: a second call while the hash runs returns the same thread (a caller joins it
    instead of hashing beside it); after it ends, a new call starts a thread that ends at once."""
    import threading

    import triton.runtime.cache as cache

    from batchinfer.kernels._util import warm_compile_key

    release, calls = threading.Event(), []

    def slow_key():
        calls.append(1)
        release.wait(10)
        return "key"

    monkeypatch.setattr(cache, "triton_key", slow_key)
    first = warm_compile_key()
    assert warm_compile_key() is first and first.is_alive() and first.daemon
    release.set()
    first.join(5)
    assert not first.is_alive() and len(calls) == 1
    second = warm_compile_key()
    assert second is not first
    second.join(5)
    assert len(calls) == 2  # (the real triton_key's lru_cache answers this one at once)


def test_starting_the_runtime_starts_the_compile_key(monkeypatch):
    """(On a machine without CUDA the runtime's thread fails and only logs it.)"""
    import batchinfer.engine.device_runtime as runtime

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "warm_compile_key", lambda: started.append(1))
    thread = runtime.start_device_runtime("cuda")
    assert thread is not None and started == [1]
    thread.join(30)


def test_a_start_while_one_runs_returns_that_thread(monkeypatch):
    """The CLI starts the runtime as soon as the job is read and the local executor starts it again:
    the second call finds the first thread instead of starting another."""
    import threading

    import batchinfer.engine.device_runtime as runtime

    release = threading.Event()

    def slow_device(dev):  # the CUDA context being created, until released (then it fails: no GPU here)
        release.wait(10)
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "warm_compile_key", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", slow_device)
    first = runtime.start_device_runtime("cuda")
    assert first is not None and runtime.start_device_runtime("cuda") is first
    release.set()
    first.join(10)
    assert not first.is_alive()


@pytest.mark.parametrize(
    "executor, data_parallel, starts",
    [("local", 1, True), ("local", 2, False), ("local", "auto", False), ("data_parallel", 1, False), ("ray", 1, False)],
)
def test_start_ahead_starts_the_runtime_only_for_an_engine_in_this_process(monkeypatch, executor, data_parallel, starts):
    import batchinfer.engine.device_runtime as runtime
    from batchinfer.job.executors import start_ahead
    from batchinfer.job.spec import JobSpec

    spec = JobSpec.model_validate({
        "model": {"path": "m"}, "input": {"path": "in.jsonl", "id_column": "id"}, "output": {"path": "out"},
        "prompt": {"template": "{{ text }}"}, "engine": {"device": "cuda", "data_parallel": data_parallel},
    })
    started: list[str] = []
    monkeypatch.setattr(runtime, "start_device_runtime", lambda device: started.append(device))
    start_ahead(executor, spec)
    assert started == (["cuda"] if starts else [])
