"""CUDA graphs of whole steps, and the one way they are captured (GraphCapturer).

DecodeGraphs: decode-only steps for a ladder of batch sizes; MixedGraphs: steps that prefill, for a
ladder of padded token counts. Either captures its largest size at start-up and each other size the
first time a step needs it (_LadderGraphs).

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the
host, not the GPU, sets the pace. Each graph replays a whole step (embedding, every layer, final
norm, LM head) with one launch. A graph's shapes are fixed, so a step runs the graph of the next
ladder size >= its size; the padding rows write no KV and attend over nothing, and their logits are
dropped.

Graphs read their inputs from static device buffers: here the model's (input ids, positions, the
sampled rows), the attention backend's for its metadata (`AttentionBackend.graph_buffers`: slots,
context lengths, block tables, whatever its kernels read). `run` copies the step's packed inputs
into them (device-side copies, no sync), then replays. Every kernel in the body must be graph-safe:
no host syncs and launch shapes fixed by the buffers (`AttentionBackend.graph_safe`).

Capture rules this module keeps (GraphCapturer): the body of the first size captured (the largest)
runs once before its capture on the stream the capture uses (kernels compile, cuBLAS takes its workspace for that
stream, outside the graph's pool); smaller sizes are captured without that warm-up run, and one whose
capture fails (a kernel variant that must compile first, say) is warmed up and captured again;
Python's garbage collector is off during captures (at start-up after one collection first):
a finaliser run mid-capture (another engine's graphs and pools being freed) would make a CUDA call
that invalidates the capture; `close()` releases the graphs and their memory pool.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

from batchinfer.attention.base import AttentionMetadata, GraphBuffers

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode graphs' batch sizes: max_num_seqs up to 256 rows; above it 256, 512, ... and max_num_seqs.

    A padded row of a decode step attends over nothing, writes no KV and adds only its share of the
    matmuls' FLOPs. Below the matmul ridge (~300 rows of a 16-bit model on an H100/H200) a decode
    step's matmuls take the time of reading their weights whatever the rows, so a step of any batch
    up to 256 rows replays the 256-row graph: that costs nothing on a 7B shape and at most ~0.2 ms of
    GEMM time on a 0.6B one, whose decode steps at a job's end still read the KV of their rows. Each
    other size would cost a capture: at start-up, or mid-run on first use, where it drains the
    device and runs a Python forward beside the job's host threads (sizes 16-128 captured on first
    use went with 0.36-0.52 s more engine-step time in a 2,000-document 0.6B job, in two A/Bs on H100
    hosts, BENCHMARKS.md). Above 256 rows padding costs real FLOPs, so sizes double from 256.
    """
    sizes = {256 << k for k in range(max(0, max_num_seqs.bit_length() - 8)) if 256 << k < max_num_seqs}
    return tuple(sorted(sizes | {max_num_seqs}))


def mixed_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts of the mixed-step graphs: 128, 256, 512, then every multiple of 512 up to
    max_tokens, then max_tokens itself. A step pads to the next size (at most 511 tokens, 6% of an
    8k step: padded rows cost their share of the GEMMs, and nothing in attention)."""
    sizes = {n for n in (128, 256) if n < max_tokens}
    sizes.update(range(512, max_tokens, 512))
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


def verify_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts of the verify-step graphs: every multiple of 64 up to 512, then of 128, then
    max_tokens. Every token row of a verify step samples, so a padded row costs a row of the LM head
    too: the ladder is finer than the mixed one."""
    sizes = set(range(64, min(512, max_tokens) + 1, 64))
    sizes.update(range(640, max_tokens, 128))
    sizes.add(max_tokens)
    return tuple(sorted(s for s in sizes if s <= max_tokens))


def ladder_size(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the sorted sizes that is >= n (n must not exceed the largest)."""
    return sizes[bisect.bisect_left(sizes, n)]


@contextlib.contextmanager
def _collector_off(collect_first: bool = False) -> Iterator[None]:
    """Python's garbage collector off inside the block (after one collection, with collect_first),
    back as it was after it: a finaliser run inside a capture (another engine's graphs and pools being
    freed) would make a CUDA call that invalidates the capture."""
    collecting = gc.isenabled()
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class GraphCapturer:
    """Captures run(size) into CUDA graphs that share one memory pool (only one replays at a time).

    The first capture is warmed up first: run(size) once on the capture stream (kernels compile and
    libraries set up their per-stream state outside the capture). A later size is captured directly,
    and if that capture fails (a kernel variant that must compile first, say) it is warmed up and
    captured again; a second failure raises. Why not warm every size: a warm-up is a whole forward, and
    on a 7B model the warm-ups of the mixed-step ladder (18 sizes up to 8,192 tokens) were most of its
    capture time. The garbage collector is off during every capture (_collector_off).

    `cuda`: the torch.cuda module (a test passes a recorder to check the order of these steps).
    """

    def __init__(self, run: Callable[[int], object], cuda=torch.cuda) -> None:
        self.run, self.cuda = run, cuda
        self.pool = None
        self._stream = None  # the side stream every capture records on (created on first use)

    def _warm(self, size: int, stream) -> None:
        cuda = self.cuda
        stream.wait_stream(cuda.current_stream())
        with cuda.stream(stream):
            self.run(size)
        cuda.current_stream().wait_stream(stream)
        cuda.synchronize()

    def _attempt(self, size: int, warm_first: bool, options: dict):
        """One capture of run(size) on the side stream. Not torch.cuda.graph: on entry that synchronises
        the device and empties the allocator's caches (device and pinned host). A capture only records,
        so neither is needed, and mid-run (a size captured on first use) the first drains the step in
        flight, which the host could have spent recording, and the second hands back cached blocks that
        the next eager allocations then get from the driver again. A warm-up, which does run, still
        synchronises (_warm)."""
        cuda = self.cuda
        if self._stream is None:
            self._stream = cuda.Stream()
        graph = cuda.CUDAGraph()
        if warm_first:
            self._warm(size, self._stream)
        pool = () if self.pool is None else (self.pool,)
        with cuda.stream(self._stream):
            graph.capture_begin(*pool, **options)
            try:
                out = self.run(size)
            except BaseException:
                with contextlib.suppress(Exception):  # the body's error is the one to report
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph, out

    def capture(self, size: int, **options) -> tuple[object, object]:
        """(graph, what the captured run returned) for one size; options go to CUDAGraph.capture_begin
        (capture_error_mode)."""
        warm_first = self.pool is None
        with _collector_off():
            try:
                graph, out = self._attempt(size, warm_first, options)
            except Exception as exc:
                if warm_first:
                    raise RuntimeError(f"CUDA graph capture of size {size} failed: {exc}") from exc
                try:
                    graph, out = self._attempt(size, True, options)
                except Exception as again:
                    raise RuntimeError(f"CUDA graph capture of size {size} failed: {again}") from again
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def capture_sizes(self, sizes: tuple[int, ...]) -> tuple[dict, dict]:
        """Capture every size, largest first (the first capture warmed up, the rest sharing its pool),
        with the collector off throughout after one collection (so garbage from before, such as another
        engine's graphs, is finalised before the first capture and nothing made meanwhile inside one).
        Returns {size: graph} and {size: what the captured run returned}."""
        graphs: dict[int, object] = {}
        outputs: dict[int, object] = {}
        with _collector_off(collect_first=True):
            for size in reversed(sizes):
                graphs[size], outputs[size] = self.capture(size)
            self.cuda.synchronize()
        return graphs, outputs


class _LadderGraphs:
    """What every graph kind shares: the size ladder, the model's static inputs, the backend's
    metadata buffers, the captured graphs, and their capture: the largest size at start-up, each
    smaller one the first time a step runs at it (`_graph`).

    Why not the whole ladder up front: every size costs a capture of every start-up (25-50 ms on an
    H100/H200 host, BENCHMARKS.md) before the first step can run, and only the sizes a run meets are
    worth one. A decode ladder has one size up to 256 rows; a document job's mixed steps meet most of
    theirs (15 of 18 in a 2,000-document 0.6B job, each captured in 34-71 ms mid-run, BENCHMARKS.md).
    Subclasses give `args(size)`, the body's arguments for a size (views of the static buffers).
    """

    def __init__(self, sizes: tuple[int, ...], buffers: GraphBuffers, device: torch.device) -> None:
        self.sizes = sizes
        self.attention = buffers
        self.input_ids = torch.zeros(sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(sizes[-1], dtype=torch.int64, device=device)
        self._metas = {t: buffers.meta(t) for t in sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}  # what each size's captured body returned
        self._capturer: GraphCapturer | None = None
        self.captured_on_use: list[int] = []  # sizes captured by run(), in order

    def args(self, t: int) -> tuple:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, body: Callable[..., object], all_sizes: bool = False) -> None:
        """Capture body(*args(size)) for the largest size now; the others on first use.
        all_sizes: the whole ladder now (tests, benchmarks of one step size)."""
        self._capturer = GraphCapturer(lambda t: body(*self.args(t)))
        self.graphs, self.outputs = self._capturer.capture_sizes(self.sizes if all_sizes else self.sizes[-1:])

    def _graph(self, t: int) -> torch.cuda.CUDAGraph:
        """The graph of padded size t, captured now if no step has needed it yet. The step is already
        staged on the current stream; the capture only records (on the side stream, without draining
        the step in flight), and the replay that follows, on the current stream, computes the staged
        step. thread_local: other threads' CUDA calls (none of the engine's, but a host program's)
        neither break this capture nor are refused by it."""
        graph = self.graphs.get(t)
        if graph is None:
            start = time.perf_counter()
            graph, self.outputs[t] = self._capturer.capture(t, capture_error_mode="thread_local")
            self.graphs[t] = graph
            self.captured_on_use.append(t)
            log.info("%s: size %d captured on first use in %.0f ms", type(self).__name__, t, (time.perf_counter() - start) * 1e3)
        return graph

    def padded_size(self, n: int) -> int:
        """The ladder size a step of n rows (or tokens) runs at (n must not exceed the largest)."""
        return ladder_size(self.sizes, n)

    def _stage_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.attention.stage(meta, n, size)
        return size

    def close(self) -> None:
        """Release the graphs (and with the last of them, their memory pool)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.outputs = {}, {}


class DecodeGraphs(_LadderGraphs):
    """One captured decode step per ladder size; `run(input_ids, positions, meta)` -> logits [n, V].

    buffers: the attention backend's decode-only graph buffers for max_num_seqs rows. capture(body):
    body(input_ids, positions, meta) runs the model and returns the logits of every row.
    """

    def __init__(self, buffers: GraphBuffers, max_num_seqs: int, device: torch.device) -> None:
        super().__init__(graph_batch_sizes(max_num_seqs), buffers, device)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def args(self, bs: int) -> tuple:
        return (self.input_ids[:bs], self.positions[:bs], self._metas[bs])

    def fits(self, num_tokens: int, meta: AttentionMetadata, num_samples: int) -> bool:
        """Decode-only steps (every row samples) of at most the largest size."""
        return (
            meta.decode_only and num_tokens <= self.max_batch_size and num_samples == num_tokens
            and self.attention.fits(meta)
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy a packed decode step into the static buffers, replay its graph, return logits [n, V].

        The returned tensor is the graph's own output buffer: read it (sample) before the next run.
        """
        bs = self._stage_tokens(input_ids, positions, meta)
        self._graph(bs).replay()
        return self.outputs[bs][: input_ids.shape[0]]


class MixedGraphs(_LadderGraphs):
    """CUDA graphs for steps that are not decode-only (prefill chunks, with or without decode rows).

    An eager mixed step of a small model is ~400 launches from Python (31 ms of host time for
    qwen3-0.6b on an H200 host, about as long as the step's device time; BENCHMARKS.md): whatever
    else the host must do in that step (grammar masks) then comes on top. Here the step is one
    replay. Each graph is captured for a padded token count T (mixed_graph_sizes) and runs the model
    over T rows (the attention backend's buffers pad its own launches) and the LM head over
    min(T, max_num_seqs) gathered rows (a step of T tokens samples no more) into one shared logits
    buffer. Padded token rows are never sampled.

    buffers: the attention backend's graph buffers for steps of up to max_tokens tokens.
    """

    def __init__(
        self, buffers: GraphBuffers, max_tokens: int, max_num_seqs: int, vocab_size: int,
        dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(sizes or mixed_graph_sizes(max_tokens), buffers, device)
        self.max_num_seqs = max_num_seqs
        self.sample_index = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.logits = torch.empty(max_num_seqs, vocab_size, dtype=dtype, device=device)

    def args(self, t: int) -> tuple:
        """The body's arguments for size t: views of the static buffers (the sample rows a step of t
        tokens can have)."""
        s = min(t, self.max_num_seqs)
        return (self.input_ids[:t], self.positions[:t], self._metas[t], self.sample_index[:s], self.logits[:s])

    def fits(self, num_tokens: int, meta: AttentionMetadata, num_samples: int) -> bool:
        """Whether a packed step can run as one of these graphs."""
        return (
            not meta.decode_only
            and num_tokens <= self.sizes[-1]
            and num_samples <= self.max_num_seqs
            and self.attention.fits(meta)
        )

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_index: torch.Tensor) -> int:
        """Copy a packed step into the static buffers (device-side copies, no sync); returns the
        padded size t whose graph (or body(*args(t))) computes it."""
        t = self._stage_tokens(input_ids, positions, meta)
        s = sample_index.shape[0]
        self.sample_index[:s].copy_(sample_index, non_blocking=True)
        self.sample_index[s:].zero_()  # stale rows could point past this size's T
        return t

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_index: torch.Tensor) -> torch.Tensor:
        """Stage a packed step and replay the graph of its padded size; returns the logits of its
        sampling rows (the shared buffer: sample before the next run)."""
        self._graph(self.stage(input_ids, positions, meta, sample_index)).replay()
        return self.logits[: sample_index.shape[0]]


class VerifyGraphs(MixedGraphs):
    """CUDA graphs for speculative verify steps: like MixedGraphs, but every token row may sample
    (a sequence's drafts and the token after them all need logits), so a graph of T tokens runs the
    LM head over T gathered rows. Mixed graphs gather at most their max_num_seqs rows: a verify step
    of 256 sequences with 4 drafts each samples 1,280, and ran eagerly (~30 ms of launches per step on
    the H200 host for qwen3-0.6b, BENCHMARKS.md). Steps that sample no more than a mixed graph
    gathers still replay the mixed graphs (model_runner._mixed_graph_samples).

    buffers: the attention backend's graph buffers for steps of up to max_tokens tokens.
    """

    def __init__(self, buffers: GraphBuffers, max_tokens: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(buffers, max_tokens, max_tokens, vocab_size, dtype, device, sizes=verify_graph_sizes(max_tokens))

    def fits(self, num_tokens: int, meta: AttentionMetadata, num_samples: int) -> bool:
        return not meta.decode_only and num_tokens <= self.sizes[-1] and self.attention.fits(meta)
