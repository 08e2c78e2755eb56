"""Engine configuration: one typed, frozen record that every engine part reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from batchinfer.engine.kv_cache import KV_LAYOUTS
from batchinfer.engine.speculative import SpeculativeConfig
from batchinfer.models.quant import check_keep_patterns


@dataclass(frozen=True)
class EngineConfig:
    """How to load the model and how hard to drive the device.

    model: a Hugging Face model folder, or a hub id already in the local HF cache.
    dtype: auto | bfloat16 | float16 | float32 ("auto": the checkpoint's dtype on GPU, float32 on CPU).
    quantization: none | fp8: the decoder layers' projections (q/k/v, o, gate/up, down; never the
        embeddings or the LM head) quantised to FP8 at load, per output channel, with per-token
        activation scales at every call (models/quant.py; FP8 tensor cores on a GPU of compute
        capability >= 8.9 in bfloat16, the same math dequantised elsewhere). A checkpoint already in
        FP8 (config.json quantization_config) runs as it is stored, whatever this says.
    fp8_keep: with quantization fp8, the projections left in the model's dtype (16-bit weights and
        inputs), by checkpoint module name or pattern (models/quant.py module_kept): "o_proj" (every
        layer's), "layers.0" (all of layer 0), "model.layers.29.mlp.down_proj", "re:REGEX" (from the
        start of the name). q/k/v and gate/up are fused matmuls: keep all of them or none. A
        checkpoint's own list of unquantised modules (compressed-tensors `ignore`, fp8's
        `modules_to_not_convert`) is kept too.
    device: auto | cpu | cuda | cuda:N.
    max_model_len: longest prompt + output; None means the model's max_position_embeddings.
    max_num_seqs: cap on sequences running at once.
    max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
    block_size: tokens per KV block.
    kv_cache_memory_fraction: share of free GPU memory (after a profiling forward) given to the KV cache.
    kv_cache_gib: size of the KV cache on CPU.
    kv_cache_dtype: auto (the model's dtype) | fp8_e4m3: the KV cache in float8_e4m3fn, a byte an
        element (twice the tokens in the same memory, half the bytes a decode step reads). Written as
        value / kv_cache_scale, saturated at +-448 and rounded to nearest, read back times the scale.
    kv_cache_scale: the FP8 KV cache's one scale for every layer, K and V (default 1.0: e4m3 then
        covers |values| up to 448 and keeps 3 mantissa bits down to 2^-6, which K and V of the
        supported models fit; a model with larger K or V wants a larger scale), or "auto": a K and
        a V scale per layer, calibrated at engine start from one forward over a short fixed text
        (amax x 2 / 448; engine/kv_calibration.py), logged and kept as Engine.kv_scales. Ignored
        with kv_cache_dtype auto.
    kv_cache_layout: auto | token | head, how a KV block is laid out in memory. token: [block_size,
        kv_heads, head_dim], a token's heads side by side; head: [kv_heads, block_size, head_dim], each
        KV head's keys of a block contiguous (whole blocks of one head stream from memory in one run).
        Kernels see both as [blocks, block_size, kv_heads, head_dim] through strides. auto: the
        attention backend's first choice (AttentionBackend.cache_layouts).
    num_kv_blocks: force this many KV blocks (tests; overrides both sizes above).
    enable_prefix_sharing: share KV blocks of identical full-block prefixes between sequences.
    attention_backend: auto | torch | triton | triton-balanced (auto: triton on a GPU, torch on CPU;
        triton-balanced: triton with decode attention's balanced work split, kernels/decode_launch.py).
    cuda_graphs: capture decode steps as CUDA graphs (GPU only).
    cuda_graph_max_tokens: with cuda_graphs, also capture steps that prefill (mixed steps) of up to
        this many tokens, padded to multiples of 512 (engine/cuda_graphs.py MixedGraphs; needs an
        attention backend with tile maps, i.e. triton); 0: those steps run eagerly.
    overlap: build step N+1 on the host while the device runs step N (one-step lookahead; see
        engine/engine.py); False runs the old serial loop (schedule, run, read tokens, repeat).
    grammar_backend: auto | xgrammar | llguidance | outlines.
    grammar_threads: threads that fill grammar masks (None: all CPUs but one on hosts with more than
        4 for llguidance, xgrammar's own default for xgrammar).
    grammar_share_masks: compute one mask per grammar state, not per row: JSON-schema answers of
        llguidance grammars carry a key of their state (structured/state_keys.py: inside a free string,
        where it opened and how many characters it holds), rows with equal keys copy one mask, and
        masks are kept by key across steps (engine/grammar.py, engine/mask_cache.py).
    grammar_mask_cache_mb: with grammar_share_masks, the most MiB of host memory the masks kept
        across steps may take (the table grows as keys come; a 151k vocabulary's mask is 19 KB, so
        1 GiB holds 56k states); 0: shared within a step only.
    seed: seeds the per-request seeds of requests that give none.
    load_format: safetensors (read the checkpoint) | random (random weights of the config's shapes:
        benchmarks of real shapes without a download).
    torch_threads: torch's CPU (intra-op) threads for this process. None: 1 when the engine drives a
        GPU (the host only runs small ops there, and more threads fight the grammar libraries' pools
        for the cores: docs1000-json on an H200 ran at 6,668 output tok/s with torch's default of 16
        threads, 9,465 with 2, BENCHMARKS.md); unchanged on the CPU, where torch runs the model.
    prefill_policy: how many prefill tokens a step takes (engine/prefill_policy.py): budget (all the
        token budget the decodes leave) | slack (only what the decode step absorbs by the step cost
        model, engine/step_cost.py, falling back to budget when nothing decodes, the batch is not
        full, a prefill waits too long, or there is no slack).
    slack_tolerance: with slack, how much longer than its decodes alone a step may get (0.05: 5%).
    slack_max_wait_steps: with slack, a running sequence prefilling for more steps than this since
        its admission makes the step take the whole budget.
    slack_max_idle_slots: with slack, more slots than this that could decode but do not (free with
        sequences waiting, or still prefilling) make the step take the whole budget; None:
        max(1, max_num_seqs // 32).
    speculative: speculative decoding (engine/speculative.py SpeculativeConfig, or a dict of its
        fields, e.g. {"method": "ngram+grammar", "num_tokens": 4}); None: off. Steps with drafts
        cannot look ahead (their drafts follow the tokens the step before accepts): on a GPU with
        overlap they run in two lanes of sequences taking turns (engine/lanes.py,
        `speculative.lanes`), else serially.
    step_profile_cache: on a GPU, keep what the KV sizing's profiling forward measured in the cache
        folder ($BATCHINFER_CACHE, else ~/.cache/batchinfer) and read it back on a later start with the
        same model shapes, settings, GPU and software instead of running that forward again
        (engine/step_profile_cache.py); False: profile at every start.
    """

    model: str
    dtype: str = "auto"
    quantization: str = "none"
    fp8_keep: tuple[str, ...] = ()
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.9
    kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    kv_cache_scale: float | Literal["auto"] = 1.0
    kv_cache_layout: str = "auto"
    num_kv_blocks: int | None = None
    enable_prefix_sharing: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    cuda_graph_max_tokens: int = 8192
    overlap: bool = True
    grammar_backend: str = "auto"
    grammar_threads: int | None = None
    grammar_share_masks: bool = True
    grammar_mask_cache_mb: int = 1024
    seed: int = 0
    load_format: str = "safetensors"
    torch_threads: int | None = None
    prefill_policy: str = "budget"
    slack_tolerance: float = 0.05
    slack_max_wait_steps: int = 32
    slack_max_idle_slots: int | None = None
    speculative: SpeculativeConfig | None = None
    step_profile_cache: bool = True

    def __post_init__(self) -> None:
        spec: Any = self.speculative
        if isinstance(spec, dict):
            object.__setattr__(self, "speculative", SpeculativeConfig(**spec))
        elif isinstance(spec, str):
            object.__setattr__(self, "speculative", SpeculativeConfig(method=spec))  # type: ignore[arg-type]
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, not {self.dtype!r}")
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"quantization must be none or fp8, not {self.quantization!r}")
        if isinstance(self.fp8_keep, str) or not isinstance(self.fp8_keep, (list, tuple)):
            raise ValueError(f"fp8_keep must be a list of module names or patterns, not {self.fp8_keep!r}")  # noqa: TRY004 (config errors are ValueErrors)
        object.__setattr__(self, "fp8_keep", tuple(self.fp8_keep))
        check_keep_patterns(self.fp8_keep, "fp8_keep")
        if self.fp8_keep and self.quantization != "fp8":
            raise ValueError("fp8_keep names projections kept in 16-bit under quantization fp8; quantization is none")
        if self.load_format not in ("safetensors", "random"):
            raise ValueError(f"load_format must be safetensors or random, not {self.load_format!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, not {self.kv_cache_dtype!r}")
        if self.kv_cache_layout not in ("auto",) + KV_LAYOUTS:
            raise ValueError(f"kv_cache_layout must be auto, {' or '.join(KV_LAYOUTS)}, not {self.kv_cache_layout!r}")
        if self.kv_cache_scale != "auto" and (isinstance(self.kv_cache_scale, (str, bool)) or not self.kv_cache_scale > 0):
            raise ValueError(f"kv_cache_scale must be > 0 or auto, not {self.kv_cache_scale!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        if self.grammar_mask_cache_mb < 0:
            raise ValueError("grammar_mask_cache_mb must be 0 or more")
        if self.grammar_threads is not None and self.grammar_threads < 1:
            raise ValueError("grammar_threads must be at least 1")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be at least 1")
        if self.prefill_policy not in ("budget", "slack"):
            raise ValueError(f"prefill_policy must be budget or slack, not {self.prefill_policy!r}")
        if not self.slack_tolerance >= 0:
            raise ValueError(f"slack_tolerance must be >= 0, not {self.slack_tolerance!r}")
        if self.slack_max_wait_steps < 0:
            raise ValueError(f"slack_max_wait_steps must be >= 0, not {self.slack_max_wait_steps}")
        if self.slack_max_idle_slots is not None and self.slack_max_idle_slots < 0:
            raise ValueError(f"slack_max_idle_slots must be >= 0, not {self.slack_max_idle_slots}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
