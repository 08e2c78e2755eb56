"""KV-cache sizing, the one formula: how many blocks the paged KV cache gets.

On a GPU the runner measures what the largest step needs: it runs that step once (profile_step),
reads the allocator's peak and the free memory after it, and gives the cache

    (free memory - weights not loaded yet) x kv_cache_memory_fraction - activation reserve

where the reserve is the largest step's activation peak, twice when mixed-step CUDA graphs are
captured (their memory pool keeps about one largest step's activations for good). On the CPU the
cache is kv_cache_gib. Either way it is capped at what max_num_seqs sequences of max_model_len can
ever use (there is no retention cache, so more blocks would never be touched); num_kv_blocks
overrides everything. `plan` cannot profile (no model is loaded): it calls the same function with
the free memory before loading, the weights still to load, and `estimate_activation_bytes`.
"""

from __future__ import annotations

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.kv_cache import kv_block_bytes
from batchinfer.engine.sampler import NOISE_CHUNK_ELEMENTS
from batchinfer.models.loader import ModelInfo

# Bytes per logit while sample() sorts for top-p, besides the logits themselves: the scaled float32
# copy, the sort's float32 values, int64 indices and radix-sort scratch (about one more copy of both).
SORT_BYTES_PER_LOGIT = 4 + 4 + 8 + 12
NOISE_BYTES_PER_ELEMENT = 3 * 8 + 4  # live int64 temporaries of the counter-based hash, float32 noise


def kv_cache_dtype(config: EngineConfig, info: ModelInfo):
    """The KV cache's torch dtype: the model's (auto) or float8_e4m3fn (fp8_e4m3)."""
    import torch

    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else info.dtype


def max_blocks_per_seq(config: EngineConfig, info: ModelInfo) -> int:
    """Blocks one sequence of the longest allowed length holds."""
    max_len = config.max_model_len or info.max_position_embeddings
    return -(-max_len // config.block_size)


def mixed_graphs_reserve(config: EngineConfig) -> bool:
    """Whether mixed-step CUDA graphs would be captured (their pool is reserved for)."""
    return config.cuda_graphs and config.cuda_graph_max_tokens > 0


def kv_cache_bytes(
    config: EngineConfig,
    device_type: str,
    *,
    free_bytes: int = 0,
    activation_bytes: int = 0,
    unloaded_weight_bytes: int = 0,
    mixed_graphs: bool = False,
) -> int:
    """The KV cache's byte budget (module docstring). free_bytes: the device's free memory now;
    unloaded_weight_bytes: weights that will still be loaded before the cache is allocated."""
    if device_type != "cuda":
        return int(config.kv_cache_gib * (1 << 30))
    reserve = activation_bytes * (2 if mixed_graphs else 1)
    return max(0, int((free_bytes - unloaded_weight_bytes) * config.kv_cache_memory_fraction) - reserve)


def kv_cache_blocks(config: EngineConfig, info: ModelInfo, budget_bytes: int) -> int:
    """Blocks of a budget (num_kv_blocks overrides it), capped at max_num_seqs x max_blocks_per_seq;
    ValueError if not even one block fits."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(info.num_layers, config.block_size, info.num_kv_heads, info.head_dim, kv_cache_dtype(config, info))
    blocks = min(budget_bytes // per_block, config.max_num_seqs * max_blocks_per_seq(config, info))
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget_bytes} bytes) does not hold a single {per_block}-byte block")
    return int(blocks)


def estimate_activation_bytes(config: EngineConfig, info: ModelInfo) -> int:
    """An estimate, from the model's shapes, of what the runner's profile_step measures: the peak of
    the largest step, max_num_batched_tokens (T) of prefill then logits and a top-p draw for
    max_num_seqs rows (R), over the allocations made for it.

    That is the step's scratch KV cache (T tokens, every layer), plus the larger of two phases.
    Forward: the residual stream and the normed input (2 x hidden per token) plus the widest layer
    stage, the MLP (gate+up and the activated half: 3 x intermediate) or attention (qkv, normed q and
    k, the output). Sampling (engine/sampler.py): the hidden states, the logits, their float32 widening,
    then either the sort for top-p or the counter-based noise, hashed in chunks of
    NOISE_CHUNK_ELEMENTS.
    """
    d = info.dtype.itemsize
    tokens = config.max_num_batched_tokens
    rows = min(config.max_num_seqs, tokens)
    scratch_kv = tokens * 2 * info.num_layers * info.num_kv_heads * info.head_dim * kv_cache_dtype(config, info).itemsize
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    widest = max(3 * info.intermediate_size, 2 * (q + 2 * kv) + q)
    forward = tokens * (2 * info.hidden_size + widest) * d
    logits = rows * info.vocab_size
    held = logits * (d + (0 if d == 4 else 4))  # the logits and (unless float32) their widened copy
    chunk = min(rows, max(1, NOISE_CHUNK_ELEMENTS // info.vocab_size)) * info.vocab_size
    sampling = tokens * info.hidden_size * d + held + max(logits * SORT_BYTES_PER_LOGIT, logits * 4 + chunk * NOISE_BYTES_PER_ELEMENT)
    return int(scratch_kv + max(forward, sampling))
