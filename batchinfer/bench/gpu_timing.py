"""Device time of a piece of GPU work, for the benchmark scripts: the work captured once in a CUDA
graph and replayed, so the figure has no host launch cost in it."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median milliseconds of one replay of fn captured in a CUDA graph (fn runs once eagerly on a
    side stream first: it compiles there, and fails there for a launch the GPU cannot run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
