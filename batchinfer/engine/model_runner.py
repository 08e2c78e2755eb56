"""The model runner: owns the model, the KV cache tensors and the CUDA graphs; runs one scheduled step.

For a step it packs the scheduled chunks into flat input_ids/positions and the slot mapping
(vectorised with numpy), has the attention backend build the rest of its metadata
(`AttentionBackend.build_metadata`), runs the model, keeps the hidden state of the last token of
each sequence that samples this step, computes logits, applies the per-row bans (min_tokens) and
the grammar bitmask, and samples. On a GPU with a graph-safe attention backend, decode-only steps
and steps of up to cuda_graph_max_tokens tokens replay CUDA graphs captured at start-up
(engine/cuda_graphs.py; `EngineConfig.cuda_graphs` turns them off); other steps run eagerly.
The KV cache is sized by engine/kv_budget.py from a profiled largest step.

For the engine's overlap loop, a step can be prepared before the tokens of the step in flight are
on the host: rows whose last input token is still pending gather it on the device from that step's
sampled-token tensor, and `sample_tokens` leaves the new tokens on the device (the engine copies them
to the host through engine/sampled_tokens.py, so the host syncs only when it reads them).

`close()` releases the graphs (and their memory pool), the KV cache and the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from batchinfer.attention import get_attention_backend
from batchinfer.attention.base import AttentionMetadata, concat_aligned
from batchinfer.engine import kv_budget, step_profile_cache
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.cuda_graphs import DecodeGraphs, MixedGraphs, VerifyGraphs
from batchinfer.engine.kv_cache import allocate_kv_cache, choose_kv_layout
from batchinfer.engine.logprobs import StepLogprobs, step_logprobs
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.sampler import SamplingBatch, ban_tokens_, make_sampling_batch, sample
from batchinfer.engine.sequence import Sequence
from batchinfer.kernels._util import warm_compile_key
from batchinfer.models.loader import load_model, load_model_info
from batchinfer.structured.bitmask import RowMasks, apply_token_bitmask_

logger = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF


def resolve_device(device: str) -> torch.device:
    """auto: cuda if available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA GPU is available")
    return dev


def block_table(tables: Seq[Seq[int]], width: int) -> np.ndarray:
    """int32 [len(tables), width]: row b holds tables[b] (cut at width), padded with 0.

    One C-level pass over all block ids (np.fromiter), then a masked scatter: a Python loop over
    rows cost ~1 ms per step at 256 sequences.
    """
    counts = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    table = np.zeros((len(tables), width), dtype=np.int32)
    if counts.size and counts.max() > width:
        tables = [t[:width] for t in tables]
        counts = np.minimum(counts, width)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(counts.sum()))
    table[np.arange(width)[None, :] < counts[:, None]] = flat
    return table


def sample_rows(ends: np.ndarray, samples: Seq[bool], widths: Seq[int] | None = None) -> np.ndarray:
    """int64 token rows whose logits are kept: the last widths[k] rows before ends[i] of the k-th
    chunk i that samples (widths None: its last row). ends: each chunk's end row (cumulative)."""
    last = ends[np.asarray(samples, dtype=bool)]
    if widths is None:
        return last - 1
    w = np.asarray(widths, dtype=np.int64)
    total = int(w.sum())
    if total == last.shape[0]:
        return last - 1
    # row j of chunk k: last[k] - w[k] + j, for j < w[k]
    first = np.cumsum(w) - w
    return np.repeat(last - w - first, w) + np.arange(total, dtype=np.int64)


@dataclass
class StepBatch:
    """The packed inputs of one step; sample_index[i] is the token row whose logits row i samples."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    gather_dst: torch.Tensor | None = None  # token rows whose input id comes from the in-flight step
    gather_src: torch.Tensor | None = None  # ... and the rows of its sampled tokens that hold them


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, executes steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # start-up phases (name, perf_counter start, end): the job's phase timer and `bench job` read them
        self.startup_spans: list[tuple[str, float, float]] = []
        t = time.perf_counter()
        self.device = resolve_device(config.device)
        compile_key = warm_compile_key() if self.device.type == "cuda" else None  # hashed while the model loads
        threads = config.torch_threads or (1 if self.device.type == "cuda" else None)
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # process-wide: see EngineConfig.torch_threads
        self.block_size = config.block_size
        shape = load_model_info(config.model, config.dtype, self.device, config.quantization, config.fp8_keep)
        fixed_scale = 1.0 if config.kv_cache_scale == "auto" else float(config.kv_cache_scale)
        self.attention = get_attention_backend(
            config.attention_backend, self.device, shape.num_heads // shape.num_kv_heads, kv_scale=fixed_scale
        )
        self.kv_layout = choose_kv_layout(config.kv_cache_layout, self.attention.cache_layouts, self.attention.name)
        self.model, self.info = load_model(
            config.model, config.dtype, self.device, self.attention, load_format=config.load_format,
            quantization=config.quantization, fp8_keep=config.fp8_keep,
        )
        t = self._span("model_load", t)
        if compile_key is not None:
            compile_key.join()  # before the first forward's first kernel launch, which needs the key
            t = self._span("compile_key_wait", t)
        max_pos = self.info.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len {config.max_model_len} is over the model's max_position_embeddings {max_pos}")
        self.max_model_len = config.max_model_len or max_pos
        self.max_blocks_per_seq = kv_budget.max_blocks_per_seq(config, self.info)
        self.vocab_size = self.info.vocab_size
        self.activation_peak_bytes: int | None = None  # measured by _profile_free_bytes (GPU)
        self.step_profile_cached = False  # whether it came from an earlier start's profile
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate(self.num_blocks)
        t = self._span("kv_cache", t)  # on a GPU: the profiling forward, then the allocation
        # per layer (k_scale, v_scale) of an FP8 cache calibrated at start (kv_cache_scale auto), else None
        self.kv_scales: list[tuple[float, float]] | None = None
        if config.kv_cache_scale == "auto" and self.kv_caches[0][0].dtype == torch.float8_e4m3fn:
            self.kv_scales = self.calibrate_kv_scales()
            self.model.set_kv_scales(self.kv_scales)  # before any graph capture: the scales are baked in
            t = self._span("kv_calibration", t)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if self._graphs_usable():
            buffers = self.attention.graph_buffers(
                config.max_num_seqs, config.max_num_seqs, self.max_blocks_per_seq, True, self.device
            )
            self.graphs = DecodeGraphs(buffers, config.max_num_seqs, self.device)
            self.graphs.capture(self._logits_all)
            t = self._span("graph_capture_decode", t)
        tokens = self._mixed_graph_tokens()
        if tokens:
            buffers = self.attention.graph_buffers(tokens, config.max_num_seqs, self.max_blocks_per_seq, False, self.device)
            self.mixed_graphs = MixedGraphs(buffers, tokens, self._mixed_graph_samples(tokens), self.vocab_size,
                                            self.info.dtype, self.device)
            self.mixed_graphs.capture(self._logits_at)
            t = self._span("graph_capture_mixed", t)
        self.verify_graphs: VerifyGraphs | None = None
        tokens = self._verify_graph_tokens()
        if tokens:
            buffers = self.attention.graph_buffers(tokens, config.max_num_seqs, self.max_blocks_per_seq, False, self.device)
            self.verify_graphs = VerifyGraphs(buffers, tokens, self.vocab_size, self.info.dtype, self.device)
            self.verify_graphs.capture(self._logits_at)
            t = self._span("graph_capture_verify", t)
        if self.device.type == "cuda":
            self._warm_up_sampling()
            self._span("sampling_warm_up", t)

    def _span(self, name: str, start: float) -> float:
        """Record start-up phase `name` from `start` to now; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.startup_spans.append((name, start, now))
        return now

    def close(self) -> None:
        """Release the CUDA graphs and their pools, the KV cache and the model (idempotent); the
        runner cannot run steps afterwards."""
        for graphs in (self.graphs, self.mixed_graphs, self.verify_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.mixed_graphs = self.verify_graphs = None
        self.kv_caches = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what was freed goes back to the device, not only to torch's cache

    @torch.inference_mode()
    def _warm_up_sampling(self) -> None:
        """Draw once at 1, 2, 4, ... rows and max_num_seqs, greedy and sampled, and apply a grammar
        bitmask once, on logits of the LM head's dtype, so that the sampler's kernel variants (its
        vocabulary split count follows the rows) load at start-up instead of in the middle of a run."""
        most = self.config.max_num_seqs
        for bs in sorted({1 << k for k in range(most.bit_length()) if 1 << k < most} | {most}):
            logits = torch.randn(bs, self.vocab_size, device=self.device, dtype=self.info.dtype)
            if bs == 1:
                allowed = RowMasks(torch.full((1, -(-self.vocab_size // 32)), -1, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int64))
                apply_token_bitmask_(logits, allowed)
            for temperature in (0.0, 1.0):
                sb = make_sampling_batch([SamplingParams(temperature=temperature)] * bs, [0] * bs, [0] * bs, self.device)
                sample(logits, sb)
        torch.cuda.synchronize(self.device)

    def _graphs_usable(self) -> bool:
        """CUDA graphs need a GPU and a graph-safe attention backend."""
        return self.config.cuda_graphs and self.device.type == "cuda" and self.attention.graph_safe

    def _mixed_graph_tokens(self) -> int:
        """Largest step (tokens) captured as a mixed-step graph; 0: none (no graphs, or
        EngineConfig.cuda_graph_max_tokens 0)."""
        if not self._graphs_usable():
            return 0
        return min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)

    def _mixed_graph_samples(self, tokens: int) -> int:
        """Sampling rows a mixed-step graph gathers for its LM head: max_num_seqs; with speculation
        whose steps can verify drafts beside prefill (drafts before prompts, speculative.prefill_first
        off, or lane steps carrying prefill, lanes_drain off), every running sequence's k+1 verify rows
        (at most the graph's tokens), so a step with a prefill chunk and drafts replays a graph instead
        of ~19 ms of eager launches (BENCHMARKS.md twentieth session). A graph of T tokens gathers at
        most T of them (MixedGraphs.args)."""
        spec = self.config.speculative
        if spec is None or (spec.prefill_first and spec.lanes_drain):
            return self.config.max_num_seqs
        return self._verify_rows(tokens)

    def _verify_rows(self, tokens: int) -> int:
        """The most rows a speculative step of `tokens` tokens samples: k+1 per running sequence."""
        return min(tokens, self.config.max_num_seqs * (1 + self.config.speculative.num_tokens))

    def _verify_graph_tokens(self) -> int:
        """Largest speculative verify step (tokens) captured as a graph: a step with drafts has at most
        speculative.max_step_tokens tokens (speculative.py); 0: none (no speculation, no mixed graphs, or
        mixed graphs wide enough to gather every verify row, which then replay verify steps too)."""
        spec, tokens = self.config.speculative, self._mixed_graph_tokens()
        if spec is None or not tokens:
            return 0
        if self._mixed_graph_samples(tokens) >= self._verify_rows(tokens):
            return 0
        return min(spec.max_step_tokens, tokens)

    def _logits_all(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The body of a decode graph: the model and the LM head over every row."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def _logits_at(self, input_ids, positions, meta: AttentionMetadata, sample_index, out: torch.Tensor) -> torch.Tensor:
        """The body of a mixed-step graph: the model, then the LM head over the rows in sample_index."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden.index_select(0, sample_index), out=out)

    # --- KV cache sizing --------------------------------------------------------------------

    def _allocate(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        i = self.info
        dtype = kv_budget.kv_cache_dtype(self.config, i)
        return allocate_kv_cache(i.num_layers, num_blocks, self.block_size, i.num_kv_heads, i.head_dim, dtype, self.device,
                                 self.kv_layout)

    def _num_blocks(self) -> int:
        """num_kv_blocks if given; else the CPU budget or the GPU's free memory after profiling
        (engine/kv_budget.py)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free = self._profile_free_bytes()
            budget = kv_budget.kv_cache_bytes(
                self.config, "cuda", free_bytes=free, activation_bytes=self.activation_peak_bytes,
                mixed_graphs=bool(self._mixed_graph_tokens()),
            )
        else:
            budget = kv_budget.kv_cache_bytes(self.config, self.device.type)
        return kv_budget.kv_cache_blocks(self.config, self.info, budget)

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run the largest step once; keep its activation peak (activation_peak_bytes) and return the
        free device memory after it. With EngineConfig.step_profile_cache, a profile of an earlier
        start with the same key is read back instead (engine/step_profile_cache.py): the free memory
        now, less what that forward left in use.

        Memory torch's allocator holds but no tensor uses (an engine closed earlier in this process
        left its KV cache there) counts as free: the cache is emptied before measuring. Measured
        without that, an engine built after another in one process (the bench's oracle run, a
        notebook, a reused worker) sized its KV cache from what the driver saw free: after the bench's
        plain recording run, docs1000 ran ~25 sequences at a time instead of 256."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        path = self._step_profile_path()
        cached = step_profile_cache.read(path) if path is not None else None
        if cached is not None:
            self.activation_peak_bytes = cached.activation_peak_bytes
            self.step_profile_cached = True
            logger.info("KV sizing: the largest step's profile read from %s", path)
            return max(0, free_before - cached.retained_bytes)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_step()
        torch.cuda.synchronize(self.device)
        self.activation_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        if path is not None:
            step_profile_cache.write(path, step_profile_cache.StepProfile(self.activation_peak_bytes, max(0, free_before - free)))
        return free

    def _step_profile_path(self):
        """Where this start's step profile is kept (None: EngineConfig.step_profile_cache off)."""
        if not self.config.step_profile_cache:
            return None
        import triton

        props = torch.cuda.get_device_properties(self.device)
        device = {"name": props.name, "total_memory": props.total_memory, "capability": [props.major, props.minor]}
        software = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__}
        shapes = {k: v for k, v in dataclasses.asdict(self.info).items() if k not in ("model_dir", "eos_token_ids")}
        config_json = self.info.model_dir / "config.json"
        if config_json.is_file():  # the architecture's own settings too (a kind of norm, tied embeddings)
            shapes["config_json"] = hashlib.sha256(config_json.read_bytes()).hexdigest()
        key = step_profile_cache.profile_key(self.config, shapes, self.max_model_len, device, software)
        return step_profile_cache.path_for(key)

    @torch.inference_mode()
    def calibrate_kv_scales(self, tokenizer=None) -> list[tuple[float, float]]:
        """Per layer (k_scale, v_scale) for the FP8 KV cache from one forward over the calibration texts
        (engine/kv_calibration.py) in a scratch cache of the model's dtype. tokenizer None: the
        model's own (the fixed pseudo-random ids if it has none that loads)."""
        from batchinfer.engine import kv_calibration
        from batchinfer.models.loader import ModelLoadError, load_tokenizer

        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(self.info.model_dir)
            except ModelLoadError:
                tokenizer = None
        ids = kv_calibration.calibration_token_ids(tokenizer, self.vocab_size)
        ids = [x[: self.max_model_len] for x in ids]
        lens = [len(x) for x in ids]
        bounds = np.cumsum([0] + [-(-n // self.block_size) for n in lens]).tolist()
        tables = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        i = self.info
        caches = allocate_kv_cache(i.num_layers, bounds[-1], self.block_size, i.num_kv_heads, i.head_dim, i.dtype, self.device,
                                   self.kv_layout)

        def run():
            batch = self._pack([0] * len(lens), lens, ids, tables, [False] * len(lens))
            self.model(batch.input_ids, batch.positions, caches, batch.meta)

        self.model.set_kv_scales(None)
        scales = kv_calibration.scales_from_amax(kv_calibration.measure_kv_amax(self.model, run))
        logger.info("kv_cache_scale auto: %s", kv_calibration.describe(scales))
        return scales

    @torch.inference_mode()
    def profile_step(self) -> torch.Tensor:
        """The largest step the scheduler can build: max_num_batched_tokens of prefill (in sequences
        of at most max_model_len) in a scratch cache, then logits and sampling for max_num_seqs rows.
        Returns the sampled tokens (the memory it used is freed on return)."""
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        bounds = np.cumsum([0] + [-(-n // self.block_size) for n in lens]).tolist()
        tables = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        caches = self._allocate(bounds[-1])
        batch = self._pack([0] * len(lens), lens, [[0] * n for n in lens], tables, [True] * len(lens))
        hidden = self.model(batch.input_ids, batch.positions, caches, batch.meta)
        rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:1].expand(rows, -1).contiguous())
        return sample(logits, make_sampling_batch([SamplingParams(top_p=0.9)] * rows, [0] * rows, [0] * rows, self.device))

    # --- one step ---------------------------------------------------------------------------

    def prepare(
        self,
        seqs: Seq[Sequence],
        num_tokens: Seq[int],
        samples: Seq[bool],
        pending: torch.Tensor | None = None,
        sample_widths: Seq[int] | None = None,
        defer_gather: bool = False,
    ) -> StepBatch:
        """Pack the scheduled chunks: seqs[i] computes num_tokens[i] tokens from its num_computed.

        pending: the sampled tokens (on the device) of the step still in flight. A sequence with a
        `pending_row` ends with a placeholder token; when its chunk reaches that last token, the
        input id is gathered on the device from pending[pending_row] (no host sync).
        defer_gather: pack now, gather later (gather_pending), because the step that samples those
        tokens is not launched yet (the engine packs step N+1 while step N's masks fill).
        sample_widths: logits rows per sampling chunk, in order (speculative verify: its last
        1 + drafts tokens); default one, the chunk's last token.
        """
        starts = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[c : c + n] for s, c, n in zip(seqs, starts, num_tokens)]
        gather = None
        rows = [
            (i, s.pending_row)
            for i, (s, c, n) in enumerate(zip(seqs, starts, num_tokens))
            if s.pending_row is not None and c + n == s.num_tokens
        ]
        if rows:
            gather = (np.array([i for i, _ in rows], dtype=np.int64), np.array([r for _, r in rows], dtype=np.int64))
        batch = self._pack(starts, list(num_tokens), ids, [s.block_ids for s in seqs], samples, gather, sample_widths)
        if not defer_gather:
            self.gather_pending(batch, pending)
        return batch

    def gather_pending(self, batch: StepBatch, pending: torch.Tensor | None) -> None:
        """Write the input ids that wait on the in-flight step (prepare's gather) from its sampled
        tokens `pending`, on the device; nothing to do when no row waits."""
        if batch.gather_dst is None:
            return
        if pending is None:
            raise RuntimeError("sequences wait on an in-flight token but no pending token tensor was given")
        with torch.no_grad():
            batch.input_ids.index_copy_(0, batch.gather_dst, pending.index_select(0, batch.gather_src))

    def _pack(self, starts, lens, ids, tables, samples, gather=None, sample_widths=None) -> StepBatch:
        """Flat inputs + AttentionMetadata from per-sequence starts, chunk lengths, token ids, blocks.

        gather: (chunk indices, rows) of chunks whose last input id comes from the in-flight step's
        sampled tokens; their token positions and the rows ride in the same int64 host->device copy.
        sample_widths: see prepare (the sample index rides in that copy too).
        """
        bs = self.block_size
        starts_np = np.asarray(starts, dtype=np.int64)
        lens_np = np.asarray(lens, dtype=np.int64)
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens_np, out=cu[1:])
        total = int(cu[-1])
        row = np.repeat(np.arange(len(lens)), lens_np)
        positions = np.arange(total, dtype=np.int64) - cu[row] + starts_np[row]
        seq_lens = starts_np + lens_np
        width = max(1, int(-(-seq_lens.max() // bs)))
        table = block_table(tables, width)
        slots = table[row, positions // bs].astype(np.int64) * bs + positions % bs
        flat_ids = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
        sample_index = sample_rows(cu[1:], samples, sample_widths)
        # Two host->device copies per step: all int64 arrays in one buffer, all int32 in another.
        parts = [flat_ids, positions, slots, sample_index]
        if gather is not None:
            parts += [cu[1:][gather[0]] - 1, gather[1]]
        longs_np, lo = concat_aligned(parts)
        longs = self._to_device(longs_np)
        meta = self.attention.build_metadata(lens_np, seq_lens, table, longs[lo[2] : lo[2] + total], self._to_device)
        batch = StepBatch(
            input_ids=longs[lo[0] : lo[0] + total],
            positions=longs[lo[1] : lo[1] + total],
            meta=meta,
            sample_index=longs[lo[3] : lo[3] + len(sample_index)],
        )
        if gather is not None:
            g = len(gather[0])
            batch.gather_dst, batch.gather_src = longs[lo[4] : lo[4] + g], longs[lo[5] : lo[5] + g]
        return batch

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _uses_decode_graph(self, batch: StepBatch) -> bool:
        """Decode-only steps (every row samples) of at most the largest captured size replay a graph."""
        g = self.graphs
        return g is not None and g.fits(batch.input_ids.shape[0], batch.meta, batch.sample_index.shape[0])

    def _uses_mixed_graph(self, batch: StepBatch) -> bool:
        g = self.mixed_graphs
        return g is not None and g.fits(batch.input_ids.shape[0], batch.meta, batch.sample_index.shape[0])

    def _uses_verify_graph(self, batch: StepBatch) -> bool:
        g = self.verify_graphs
        return g is not None and g.fits(batch.input_ids.shape[0], batch.meta, batch.sample_index.shape[0])

    def uses_graph(self, batch: StepBatch) -> bool:
        """Whether forward(batch) replays a CUDA graph (a short launch) instead of running eagerly."""
        return self._uses_decode_graph(batch) or self._uses_mixed_graph(batch) or self._uses_verify_graph(batch)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run the model on a packed step; logits [num_sampling, V] (model dtype) of the rows that sample.

        On a GPU this only launches work, so the caller can fill grammar bitmasks meanwhile. A graph
        step returns the graph's output buffer: sample from it before the next forward.
        """
        if self._uses_decode_graph(batch):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        if self._uses_mixed_graph(batch):
            return self.mixed_graphs.run(batch.input_ids, batch.positions, batch.meta, batch.sample_index)
        if self._uses_verify_graph(batch):
            return self.verify_graphs.run(batch.input_ids, batch.positions, batch.meta, batch.sample_index)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden.index_select(0, batch.sample_index))

    @torch.inference_mode()
    def sample_tokens(
        self,
        logits: torch.Tensor,
        sampling: Seq[Sequence],
        bans: Seq[list[int]] | None = None,
        bitmask: torch.Tensor | RowMasks | None = None,
        steps: Seq[int] | None = None,
        widths: Seq[int] | None = None,
    ) -> torch.Tensor:
        """Bans and grammar mask on the sampling rows' logits, then one token per row (in order); the
        tokens stay on the device (int64 [len(sampling)]): this only launches work.

        bans[i]: token ids forbidden for sampling[i] (min_tokens); bitmask: int32 CPU
        [len(sampling), ceil(V/32)] from the grammar matchers (rows without a grammar all -1), as a
        tensor or RowMasks (gathered on the device), or None.
        steps: the sampler's counter per row (default: each sequence's num_generated); speculative
        decoding samples several positions of one sequence in one step: widths[i] consecutive rows
        are sampling[i]'s (default one each; bans, bitmask and steps are then per row).
        """
        if bans:
            rows = [i for i, b in enumerate(bans) if b]
            if rows:
                ban_tokens_(logits, rows, [bans[i] for i in rows])
        if bitmask is not None:
            apply_token_bitmask_(logits, bitmask)
        return sample(logits, self.sampling_batch(sampling, steps, widths))

    def token_logprobs(self, logits: torch.Tensor, sampling: Seq[Sequence], tokens: torch.Tensor) -> StepLogprobs | None:
        """Logprobs of the sampled tokens for the rows whose request asks (None, at no cost, when none
        does): from the logits sample_tokens drew from (bans and mask applied). Launching only."""
        asks = [(i, s.request.sampling.logprobs) for i, s in enumerate(sampling) if s.request.sampling.logprobs is not None]
        if not asks:
            return None
        with torch.inference_mode():
            return step_logprobs(logits, asks, tokens)

    def mark(self) -> torch.cuda.Event | None:
        """A timing event recorded now on the current CUDA stream (None on the CPU): the engine
        measures the device's idle gaps between steps with them."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sampling_batch(self, sampling: Seq[Sequence], steps: Seq[int] | None = None,
                       widths: Seq[int] | None = None) -> SamplingBatch:
        """make_sampling_batch for sequences, from rows each sequence computes once (its seed folded,
        its parameters resolved), stacked with numpy: the per-row Python of make_sampling_batch
        cost ~1 ms per step at 256 rows. widths: rows per sequence (see sample_tokens; steps is then
        given per row)."""
        rows = []
        for s in sampling:
            if s.sampling_row is None:
                one = make_sampling_batch([s.request.sampling], [s.seed], [0], "cpu")
                s.sampling_row = (
                    float(one.temperature[0]), float(one.top_p[0]), float(one.min_p[0]),
                    int(one.top_k[0]), int(one.seeds[0]), bool(one.greedy[0]),
                )
            rows.append(s.sampling_row)
        cols = list(zip(*rows))
        floats = np.array(cols[:3], dtype=np.float32)
        greedy = np.array(cols[5], dtype=bool)
        ints = np.array(cols[3:5], dtype=np.int64)
        if widths is not None:
            w = np.asarray(widths, dtype=np.int64)
            floats, greedy, ints = np.repeat(floats, w, axis=1), np.repeat(greedy, w), np.repeat(ints, w, axis=1)
        if steps is None:
            steps = np.fromiter((s.num_generated for s in sampling), dtype=np.int64, count=len(sampling)) & _MASK32
        else:
            steps = np.asarray(steps, dtype=np.int64) & _MASK32
        ints = np.concatenate([ints, steps[None, :], greedy.astype(np.int64)[None, :]])
        f_dev, i_dev = self._to_device(floats), self._to_device(ints)
        top_k, top_p, min_p = ints[0], floats[1], floats[2]
        sampled = ~greedy
        return SamplingBatch(
            temperature=f_dev[0], top_p=f_dev[1], min_p=f_dev[2],
            top_k=i_dev[0], seeds=i_dev[1], steps=i_dev[2], greedy=i_dev[3].bool(),
            all_greedy=not sampled.any(),
            any_greedy=bool(greedy.any()),
            any_top_k=bool((top_k[sampled] > 0).any()),
            any_top_p=bool((top_p[sampled] < 1.0).any()),
            any_min_p=bool((min_p[sampled] > 0.0).any()),
            all_top_k=bool(sampled.any()) and bool((top_k[sampled] > 0).all()),
            max_top_k=int(top_k[sampled].max()) if sampled.any() else 0,
        )
