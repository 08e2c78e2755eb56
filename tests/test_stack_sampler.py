"""observe/stack_sampler.py: every thread's stacks counted, and the file it writes."""

from __future__ import annotations

import threading
import time

from batchinfer.observe.stack_sampler import StackSampler, start_from_env


def _busy_wait(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


def test_samples_name_each_thread_and_its_function(tmp_path):
    stop = threading.Event()
    worker = threading.Thread(target=_busy_wait, args=(stop,), name="worker-x")
    worker.start()
    sampler = StackSampler(tmp_path / "s.txt", seconds=0.2, interval=0.002).start()
    sampler.join()
    stop.set()
    worker.join()
    text = (tmp_path / "s.txt").read_text().splitlines()
    assert text[0].startswith(f"# {sampler.samples} samples") and sampler.samples >= 10
    assert any(line.startswith("# thread worker-x:") for line in text)
    rows = [line.split(" ", 2) for line in text if not line.startswith(("#", "@"))]
    assert all(int(n) >= 1 for n, _, _ in rows)
    assert [int(n) for n, _, _ in rows] == sorted((int(n) for n, _, _ in rows), reverse=True)
    worker_rows = [stack for _, t, stack in rows if t == "worker-x"]
    assert worker_rows and all(":_busy_wait:" in stack for stack in worker_rows)
    assert not any(t == "stack-sampler" for _, t, _ in rows)


def test_started_only_when_the_variable_names_a_file(tmp_path):
    assert start_from_env({}) is None
    env = {"BATCHINFER_SAMPLE_STACKS": str(tmp_path / "d" / "s.txt"), "BATCHINFER_SAMPLE_STACKS_SECONDS": "0.05"}
    sampler = start_from_env(env)
    assert sampler is not None
    sampler.join()
    assert (tmp_path / "d" / "s.txt").read_text().startswith("# ")


def test_the_main_thread_timeline_has_a_line_per_bucket(tmp_path):
    sampler = StackSampler(tmp_path / "s.txt", seconds=0.3, interval=0.002, bucket=0.1).start()
    sampler.join()  # this (main) thread waits in join() the whole time
    lines = (tmp_path / "s.txt").read_text().splitlines()
    timeline = [line for line in lines if line.startswith("@")]
    assert 2 <= len(timeline) <= 4 and timeline[0].startswith("@0.00 ")
    assert all(":join:" in line or ":wait:" in line for line in timeline), timeline
