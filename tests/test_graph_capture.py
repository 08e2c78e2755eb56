"""The CUDA-graph capture loop's order of operations (engine/cuda_graphs.py GraphCapturer.capture_sizes).

A real capture needs a GPU (tests/test_gpu_engine.py). Here a recorder stands in for the torch.cuda
module and logs every call the loop makes, so the rules the loop exists to keep are checked on the
CPU: the largest size's warm-up runs before its capture and on the stream the capture uses, smaller
sizes are warmed up only when a capture without one fails; the garbage
collector is off during captures (finalisers of dead objects, such as another engine's graphs, run
before the first capture, never inside one) and back on afterwards, also when a capture fails; the
graphs share the first graph's memory pool.
"""

from __future__ import annotations

import gc

import pytest

from batchinfer.engine.cuda_graphs import GraphCapturer


class _Stream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))


class _Graph:
    count = 0
    cuda: "RecordingCuda"  # set by RecordingCuda

    def __init__(self) -> None:
        _Graph.count += 1
        self.id = _Graph.count

    def pool(self) -> str:
        return f"pool-of-{self.id}"

    def capture_begin(self, pool=None, **options) -> None:
        cuda = self.cuda
        cuda.log.append(("begin", self.id, pool, gc.isenabled(), cuda.current.name))
        if options:
            cuda.log.append(("options", self.id, options))
        cuda.capturing = True

    def capture_end(self) -> None:
        self.cuda.capturing = False
        self.cuda.log.append(("end", self.id))


class RecordingCuda:
    """The parts of torch.cuda the capture loop uses; every call goes to `log`."""

    def __init__(self, fail_at: int | None = None, until_warm: bool = False) -> None:
        self.log: list = []
        self.until_warm = until_warm  # fail_at's capture fails only until a warm-up of it ran
        self.warmed: set[int] = set()
        self.default = _Stream(self.log, "default")
        self.side = _Stream(self.log, "capture")
        self.current = self.default
        self.capturing = False
        self.fail_at = fail_at
        self.CUDAGraph = type("_Graph", (_Graph,), {"cuda": self})
        self.streams_made = 0
        outer = self

        class _StreamContext:
            def __init__(self, stream: _Stream) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                self.before, outer.current = outer.current, self.stream

            def __exit__(self, *exc) -> None:
                outer.current = self.before

        self.stream = _StreamContext

    def Stream(self) -> _Stream:  # noqa: N802 (torch.cuda's name)
        self.streams_made += 1
        return self.side

    def current_stream(self) -> _Stream:
        return self.current

    def synchronize(self) -> None:
        self.log.append(("sync",))

    def run(self, size: int) -> str:
        """The body: logs where it ran; raises inside the capture of `fail_at` (with until_warm,
        only before a warm-up of that size: a kernel variant that compiles on its first run)."""
        self.log.append(("run", size, self.current.name, self.capturing, gc.isenabled()))
        if not self.capturing:
            self.warmed.add(size)
        if self.capturing and size == self.fail_at and not (self.until_warm and size in self.warmed):
            raise RuntimeError("operation not permitted when stream is capturing")
        return f"out-{size}"


class _Finalised:
    """Cyclic garbage with a finaliser that logs when it runs."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.me = log, name, self

    def __del__(self) -> None:
        self.log.append(("finalised", self.name))


def test_the_largest_size_warms_up_on_the_capture_stream_and_the_rest_are_captured_directly():
    cuda = RecordingCuda()
    graphs, outputs = GraphCapturer(cuda.run, cuda).capture_sizes((1, 2, 4))
    assert sorted(graphs) == [1, 2, 4] and outputs == {4: "out-4", 2: "out-2", 1: "out-1"}
    runs = [e for e in cuda.log if e[0] == "run"]
    # largest first: its warm-up (not capturing) then its captured run; the smaller sizes captured only
    assert [(size, capturing) for _, size, _, capturing, _ in runs] == [(4, False), (4, True), (2, True), (1, True)]
    assert all(stream == "capture" for _, _, stream, _, _ in runs)
    # the side stream waits for the default one before the warm-up, and the other way round after it
    first_run = cuda.log.index(runs[0])
    assert ("wait", "capture", "default") in cuda.log[:first_run]
    first_begin = next(i for i, e in enumerate(cuda.log) if e[0] == "begin")
    assert ("wait", "default", "capture") in cuda.log[first_run:first_begin]
    assert ("sync",) in cuda.log[first_run:first_begin]
    # one pool: the first graph's, passed to every later capture
    begins = [e for e in cuda.log if e[0] == "begin"]
    first_pool = graphs[4].pool()
    assert [b[2] for b in begins] == [None, first_pool, first_pool]
    assert cuda.log[-1] == ("sync",)


def test_a_capture_that_fails_without_a_warm_up_is_warmed_and_captured_again():
    cuda = RecordingCuda(fail_at=2, until_warm=True)
    graphs, outputs = GraphCapturer(cuda.run, cuda).capture_sizes((1, 2, 4))
    assert sorted(graphs) == [1, 2, 4] and outputs[2] == "out-2"
    runs = [(e[1], e[3]) for e in cuda.log if e[0] == "run"]
    assert runs == [(4, False), (4, True), (2, True), (2, False), (2, True), (1, True)]
    assert not cuda.capturing and gc.isenabled()
    # the retry is a fresh graph in the same pool; the failed one is not kept
    begins = [e for e in cuda.log if e[0] == "begin"]
    assert len(begins) == 4 and begins[1][1] != begins[2][1] == graphs[2].id
    assert [b[2] for b in begins[1:]] == [graphs[4].pool()] * 3


def test_no_finaliser_runs_inside_a_capture():
    """Garbage from before the loop (another engine's objects) is finalised before the first capture;
    garbage made during the captures waits until the collector is back on."""
    cuda = RecordingCuda()
    gc.collect()
    assert gc.isenabled()
    _Finalised(cuda.log, "before")  # unreachable at once, but only the collector can free it

    def run(size: int) -> str:
        for i in range(3000):  # well past the collector's thresholds
            _Finalised(cuda.log, f"during-{size}-{i}")
        return cuda.run(size)

    GraphCapturer(run, cuda).capture_sizes((8, 16))
    log = list(cuda.log)  # the finalisers may log more from here on (the collector is back on)
    first_begin = next(i for i, e in enumerate(log) if e[0] == "begin")
    last_sync = max(i for i, e in enumerate(log) if e[0] == "sync")
    assert ("finalised", "before") in log[:first_begin]
    assert [e for e in log if e[0] == "begin" and e[3]] == []  # collector off at every begin
    assert [e for e in log if e[0] == "run" and e[4]] == []  # collector off during every run
    # nothing made during the loop was collected inside it
    assert [e for e in log[first_begin:last_sync] if e[0] == "finalised"] == []
    assert gc.isenabled()
    gc.collect()
    assert any(e[0] == "finalised" and e[1].startswith("during") for e in cuda.log)


def test_a_failed_capture_names_its_size_and_turns_the_collector_back_on():
    cuda = RecordingCuda(fail_at=2)
    with pytest.raises(RuntimeError, match="capture of size 2 failed: operation not permitted"):
        GraphCapturer(cuda.run, cuda).capture_sizes((1, 2, 4))
    assert gc.isenabled()
    # captured without a warm-up, failed, warmed, failed again: stopped there
    assert [e[1] for e in cuda.log if e[0] == "run"] == [4, 4, 2, 2, 2]
    assert not cuda.capturing and cuda.current is cuda.default  # the capture context was left


def test_the_collector_stays_off_when_it_was_off():
    cuda = RecordingCuda()
    gc.disable()
    try:
        GraphCapturer(cuda.run, cuda).capture_sizes((1,))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_later_capture_shares_the_pool_and_is_warmed_only_when_it_fails():
    """Sizes captured after the start-up ones (MixedGraphs on first use): the first capture's pool, no
    warm-up unless the direct capture fails (and no device sync unless it warms up), the options passed
    through to CUDAGraph.capture_begin."""
    cuda = RecordingCuda(fail_at=1, until_warm=True)
    capturer = GraphCapturer(cuda.run, cuda)
    graphs, _ = capturer.capture_sizes((4,))
    pool = graphs[4].pool()
    assert capturer.pool == pool
    del cuda.log[:]
    graph, out = capturer.capture(2, capture_error_mode="thread_local")
    assert out == "out-2" and [(e[1], e[3]) for e in cuda.log if e[0] == "run"] == [(2, True)]
    assert [e[2] for e in cuda.log if e[0] == "begin"] == [pool]
    assert ("options", graph.id, {"capture_error_mode": "thread_local"}) in cuda.log
    # a capture only records: it neither drains the device (the step in flight) nor runs anything
    assert ("sync",) not in cuda.log and [e[4] for e in cuda.log if e[0] == "begin"] == ["capture"]
    del cuda.log[:]
    capturer.capture(1)  # fails until warmed: warmed on the capture stream, then captured again
    assert [(e[1], e[3]) for e in cuda.log if e[0] == "run"] == [(1, True), (1, False), (1, True)]
    # the failed capture, the warm-up (on the capture stream, then a sync: it ran), the capture again
    assert [e[2] if e[0] == "run" else e[0] for e in cuda.log if e[0] in ("run", "sync")] == [
        "capture", "capture", "sync", "capture"]
    assert capturer.pool == pool and cuda.streams_made == 1  # one side stream for every capture


@pytest.mark.parametrize("kind", ["DecodeGraphs", "MixedGraphs"])
def test_graphs_capture_a_size_the_first_time_a_step_needs_it(kind):
    """_graph (decode and mixed graphs alike): a size without a graph is captured once (collector off
    meanwhile), with thread_local capture errors, its output kept, and recorded in captured_on_use; a
    size it has is only looked up."""
    from batchinfer.engine import cuda_graphs

    cuda = RecordingCuda()
    graphs = object.__new__(getattr(cuda_graphs, kind))  # the bookkeeping only: no device buffers on the CPU
    graphs._capturer = GraphCapturer(cuda.run, cuda)
    graphs.graphs, graphs.outputs = graphs._capturer.capture_sizes((512,))
    graphs.captured_on_use = []
    del cuda.log[:]
    assert graphs._graph(512) is graphs.graphs[512] and cuda.log == []
    g = graphs._graph(128)
    assert graphs.graphs[128] is g and graphs._graph(128) is g and graphs.captured_on_use == [128]
    assert graphs.outputs == {512: "out-512", 128: "out-128"}
    assert [e for e in cuda.log if e[0] == "run"] == [("run", 128, "capture", True, False)]
    assert ("options", g.id, {"capture_error_mode": "thread_local"}) in cuda.log
    assert gc.isenabled()
