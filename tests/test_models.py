"""Our model code against transformers on the same checkpoint (float32, CPU).

Every family, plus llama with llama3 rope scaling and a sharded checkpoint: (1) prompts of different
lengths packed into one prefill, (2) the same prompts as a prefix prefill, then chunks, then single-token
decodes through a paged cache with block_size 4 and shuffled block ids, steps mixing both kinds,
(3) a sequence that reuses another's cached prefix blocks. Logits must match within 1e-4 with the same argmax.
"""

from __future__ import annotations

import pytest
import torch

from batchinfer.attention import get_attention_backend
from batchinfer.models.loader import load_model
from batchinfer.models.rope import RotaryEmbedding, rope_config_from_hf
from batchinfer.demo import FAMILIES
from paged_batch import PagedSequences, make_caches

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
LENGTHS = (5, 11, 18)
BLOCK_SIZE, NUM_BLOCKS = 4, 64


CASES = [(family, {}) for family in FAMILIES] + [
    ("llama", {"rope_scaling": LLAMA3_ROPE}),
    ("llama", {"max_shard_size": "100KB"}),
]


@pytest.fixture(scope="module", params=CASES, ids=["llama", "mistral", "qwen2", "qwen3", "llama3-rope", "sharded"])
def checkpoint(request, model_factory):
    """(our model, info, transformers model, prompts, reference logits per prompt)."""
    from transformers import AutoModelForCausalLM

    family, overrides = request.param
    path = model_factory(family, **overrides)
    if "max_shard_size" in overrides:
        assert (path / "model.safetensors.index.json").is_file()
    ours, info = load_model(str(path), "float32", "cpu", get_attention_backend("torch", "cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    return ours, info, hf, prompts, refs


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def new_run(info):
    return PagedSequences(NUM_BLOCKS, BLOCK_SIZE, seed=1), make_caches(
        info.num_layers, NUM_BLOCKS, BLOCK_SIZE, info.num_kv_heads, info.head_dim
    )


def test_packed_prefill_matches_transformers(checkpoint):
    model, info, _, prompts, refs = checkpoint
    seqs, caches = new_run(info)
    ids, positions, meta = seqs.step([(seqs.add(), p) for p in prompts])
    hidden = model(ids, positions, caches, meta)
    assert hidden.shape == (sum(LENGTHS), info.hidden_size)
    assert_close(model.compute_logits(hidden), torch.cat(refs))


def test_chunked_prefill_and_decode_match_transformers(checkpoint):
    model, info, _, prompts, refs = checkpoint
    seqs, caches = new_run(info)
    for _ in prompts:
        seqs.add()
    # Each entry: per sequence, how many of its prompt tokens this step feeds (0: not in the step).
    schedule = [(3, 0, 6), (2, 5, 0), (1, 4, 5), (1, 1, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1)]
    done = [0] * len(prompts)
    for counts in schedule:
        chunks = []
        for s, n in enumerate(counts):
            n = min(n, len(prompts[s]) - done[s])
            if n:
                chunks.append((s, prompts[s][done[s] : done[s] + n]))
        ids, positions, meta = seqs.step(chunks)
        logits = model.compute_logits(model(ids, positions, caches, meta))
        expected = torch.cat([refs[s][done[s] : done[s] + len(tokens)] for s, tokens in chunks])
        assert_close(logits, expected)
        for s, tokens in chunks:
            done[s] += len(tokens)
    assert done == [len(p) for p in prompts]


def test_prefix_sharing_matches_transformers(checkpoint):
    model, info, _, prompts, refs = checkpoint
    seqs, caches = new_run(info)
    first = seqs.add()
    ids, positions, meta = seqs.step([(first, prompts[2])])
    model(ids, positions, caches, meta)
    shared = seqs.share_prefix(first, 8)  # reuses 2 full blocks, computes only the rest
    ids, positions, meta = seqs.step([(shared, prompts[2][8:])])
    assert_close(model.compute_logits(model(ids, positions, caches, meta)), refs[2][8:])


def test_num_params_and_tied_embeddings(checkpoint):
    model, info, hf, _, _ = checkpoint
    assert info.num_params == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    assert (model.lm_head is model.embed_tokens) == model.config.tie_word_embeddings
    in_layers = sum(p.numel() for name, p in hf.named_parameters() if ".layers." in name)
    assert info.num_layer_params == in_layers


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        dict(LLAMA3_ROPE, rope_theta=500000.0),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1000000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rotary_cache_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=2048, rope_parameters=rope)
    positions = torch.tensor([0, 1, 7, 300, 1000, 2047])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(64, 2048, rope_config_from_hf(config.to_dict())).cos_sin_cache[positions]
    half = ours.shape[-1] // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :32], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :32], rtol=1e-5, atol=1e-5)


def test_old_style_rope_scaling_is_read():
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = rope_config_from_hf(old)
    assert (cfg.theta, cfg.rope_type, cfg.get("factor")) == (500000.0, "linear", 2.0)
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        rope_config_from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_bfloat16_load(tiny_model):
    model, info = load_model(str(tiny_model), "bfloat16", "cpu", get_attention_backend("torch", "cpu"))
    assert info.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    caches = make_caches(info.num_layers, NUM_BLOCKS, BLOCK_SIZE, info.num_kv_heads, info.head_dim, torch.bfloat16)
    ids, positions, meta = seqs.step([(seqs.add(), [1, 2, 3, 4, 5])])
    logits = model.compute_logits(model(ids, positions, caches, meta))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_matches_cpu_reference(tiny_model, dtype):
    """On a GPU (torch backend): same logits as transformers on CPU (tight in float32, loose in bfloat16)."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    model, info = load_model(str(tiny_model), dtype, device, get_attention_backend("torch", device))
    assert model.device.type == "cuda" and model.dtype == info.dtype
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    caches = [
        (k.to(device, info.dtype), v.to(device, info.dtype))
        for k, v in make_caches(info.num_layers, NUM_BLOCKS, BLOCK_SIZE, info.num_kv_heads, info.head_dim)
    ]
    seq = seqs.add()
    logits = []
    for chunk in (prompt[:20], prompt[20:30], *([t] for t in prompt[30:])):
        ids, positions, meta = seqs.step([(seq, chunk)])
        meta.slot_mapping, meta.query_start_loc = meta.slot_mapping.to(device), meta.query_start_loc.to(device)
        meta.seq_lens, meta.block_tables = meta.seq_lens.to(device), meta.block_tables.to(device)
        logits.append(model.compute_logits(model(ids.to(device), positions.to(device), caches, meta)).cpu())
    tolerance = 1e-3 if dtype == "float32" else 0.1
    assert (torch.cat(logits) - ref).abs().max().item() < tolerance * max(1.0, ref.abs().max().item())
