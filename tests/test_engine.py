"""The engine end to end on CPU with small random models, checked against transformers' generate."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

GREEDY = dict(temperature=0.0)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, float32)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None
    )
    return out[0, len(prompt) :].tolist()


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def make_engine(path, on_step=None, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 8)
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", **kw), on_step=on_step)


def count_shares(engine: Engine) -> list[int]:
    """Wrap the allocator's share() to count prefix-shared blocks."""
    shared: list[int] = []
    original = engine.allocator.share

    def share(block_id: int) -> None:
        shared.append(block_id)
        original(block_id)

    engine.allocator.share = share
    return shared


def test_greedy_matches_transformers_every_family(family_model):
    family, path = family_model
    rng = random.Random(1)
    prefix = rand_prompt(rng, 40)
    prompts = [rand_prompt(rng, n) for n in (3, 17, 90, 33)]
    prompts += [prefix + rand_prompt(rng, n) for n in (1, 9, 20)]
    max_new = 12
    stats = []
    engine = make_engine(path, max_num_batched_tokens=32, max_num_seqs=8, on_step=stats.append)
    shared = count_shares(engine)
    reqs = [Request(f"p{i}", p, SamplingParams(max_tokens=max_new, **GREEDY)) for i, p in enumerate(prompts)]
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert set(results) == {r.request_id for r in reqs}
    hf = load_hf(path)
    for i, p in enumerate(prompts):
        r = results[f"p{i}"]
        expected = hf_greedy(hf, p, max_new)
        assert r.output_token_ids == expected, f"{family}: prompt {i} ({len(p)} tokens) differs from transformers"
        assert r.finish_reason in ("stop", "length") and r.error is None
        assert r.completion_tokens == len(expected) and r.prompt_tokens == len(p)
    assert len(shared) >= 5, "the common 40-token prefix (5 blocks of 8) was never shared"
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 32 for s in stats)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats), "no step mixed prefill and decode"
    assert stats[-1].kv_blocks_used == 0 and engine.allocator.num_free == 256


def test_preemption_with_a_tiny_cache_matches_transformers(tiny_model):
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (20, 31, 12, 26)]
    max_new = 16
    # 14 blocks of 4 tokens = 56 tokens of KV for 4 sequences of up to 47 tokens each.
    stats = []
    engine = make_engine(tiny_model, num_kv_blocks=14, block_size=4, max_num_batched_tokens=64, on_step=stats.append)
    engine.scheduler.config = replace(engine.scheduler.config, max_reserved_output=0)  # admit eagerly
    reqs = [
        Request(f"p{i}", p, SamplingParams(max_tokens=max_new, ignore_eos=True, **GREEDY)) for i, p in enumerate(prompts)
    ]
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert sum(r.num_preemptions for r in results.values()) > 0, "the tiny cache never forced a preemption"
    assert sum(s.num_preemptions for s in stats) == sum(r.num_preemptions for r in results.values())
    hf = load_hf(tiny_model)
    for i, p in enumerate(prompts):
        r = results[f"p{i}"]
        assert r.finish_reason == "length" and len(r.output_token_ids) == max_new
        expected = hf_greedy_ignore_eos(hf, p, max_new)
        assert r.output_token_ids == expected, f"prompt {i} differs after preemption"
    engine.allocator.check()
    assert engine.allocator.num_free == 14


def hf_greedy_ignore_eos(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        top_k=None,
        top_p=None,
    )
    return out[0, len(prompt) :].tolist()


def test_impossible_and_invalid_requests_give_error_results(tiny_model):
    engine = make_engine(tiny_model, num_kv_blocks=8, block_size=8, max_model_len=128)
    vocab = engine.model_info.vocab_size
    reqs = [
        Request("ok", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY)),
        Request("too_long", list(range(3, 120)), SamplingParams(max_tokens=20)),
        Request("too_big_for_cache", list(range(3, 60)), SamplingParams(max_tokens=20)),
        Request("bad_id", [5, vocab + 3], SamplingParams(max_tokens=4)),
        Request("negative_id", [5, -1], SamplingParams(max_tokens=4)),
        Request("empty", [], SamplingParams(max_tokens=4)),
        Request("not_ints", [5.5, 6], SamplingParams(max_tokens=4)),
        Request("nested", [[5, 6]], SamplingParams(max_tokens=4)),
    ]
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert results["ok"].finish_reason in ("stop", "length") and results["ok"].error is None
    for rid, needle in [
        ("too_long", "max_model_len"),
        ("too_big_for_cache", "KV blocks"),
        ("bad_id", "vocabulary"),
        ("negative_id", "vocabulary"),
        ("empty", "empty"),
        ("not_ints", "integer token ids"),
        ("nested", "integer token ids"),
    ]:
        r = results[rid]
        assert r.finish_reason == "error" and needle in r.error and rid in r.error
        assert r.output_token_ids == [] and r.completion_tokens == 0


def test_lazy_pulling_from_an_infinite_stream(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    pulled = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            yield Request(f"r{i}", [5 + i % 50, 9, 11], SamplingParams(max_tokens=3, ignore_eos=True))

    out = list(itertools.islice(engine.generate(endless()), 6))
    assert len({r.request_id for r in out}) == 6
    assert len(pulled) <= 6 + 2 + 2 * 2 + 1  # finished + running + waiting (+ one being added)
    # Stopping early frees everything; the engine is reusable.
    assert engine.allocator.num_free == 256 and not engine.scheduler.running and not engine.scheduler.waiting
    first = engine.generate([Request("y", [5, 6], SamplingParams(max_tokens=2))])
    next(first)
    with pytest.raises(RuntimeError, match="already running"):
        next(engine.generate([]))
    first.close()
    again = list(engine.generate([Request("x", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))]))
    assert [r.completion_tokens for r in again] == [2]


def test_max_tokens_length_eos_ignore_eos_min_tokens_and_stops(tiny_model, model_factory):
    prompt = [7, 30, 200, 41, 99, 123]
    base = make_engine(tiny_model)
    (free_run,) = base.generate([Request("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))])
    out = free_run.output_token_ids
    assert free_run.finish_reason == "length" and len(out) == 12 and free_run.completion_tokens == 12
    assert free_run.times.arrived <= free_run.times.scheduled <= free_run.times.first_token <= free_run.times.finished

    # A model identical but for its EOS id, chosen as a token the greedy run emits: stop there.
    eos = out[3]
    k = out.index(eos)
    engine = make_engine(model_factory("qwen3", eos_token_id=eos))
    assert eos in engine.model_info.eos_token_ids
    reqs = [
        Request("eos", prompt, SamplingParams(max_tokens=12, **GREEDY)),
        Request("ignore", prompt, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)),
        Request("min", prompt, SamplingParams(max_tokens=12, min_tokens=k + 2, **GREEDY)),
    ]
    res = {r.request_id: r for r in engine.generate(reqs)}
    assert res["eos"].output_token_ids == out[: k + 1] and res["eos"].finish_reason == "stop"
    tok = engine.tokenizer
    assert res["eos"].text == tok.decode(out[:k], skip_special_tokens=True)
    assert res["ignore"].output_token_ids == out and res["ignore"].finish_reason == "length"
    assert eos not in res["min"].output_token_ids[: k + 2]

    # stop_token_ids end the output like EOS (the id is kept, its text is not).
    stop_id = out[5]
    j = out.index(stop_id)
    (r,) = base.generate([Request("s", prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True, **GREEDY))])
    assert r.output_token_ids == out[: j + 1] and r.finish_reason == "stop"
    assert r.text == tok.decode(out[:j], skip_special_tokens=True)

    # A stop string is cut from the text.
    full = tok.decode(out, skip_special_tokens=True)
    stop = next(full[i : i + 3] for i in range(2, len(full) - 3) if full[i : i + 3].strip())
    (r,) = base.generate([Request("t", prompt, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True, **GREEDY))])
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)]
    assert r.output_token_ids == out[: len(r.output_token_ids)]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model):
    engine = make_engine(tiny_model, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([Request("x", [5, 6, 7, 8], params)])
    rng = random.Random(3)
    others = [Request(f"o{i}", rand_prompt(rng, 5 + 7 * i), SamplingParams(max_tokens=8, temperature=0.8)) for i in range(4)]
    mixed = {r.request_id: r for r in engine.generate(others[:2] + [Request("x", [5, 6, 7, 8], params)] + others[2:])}
    assert mixed["x"].output_token_ids == alone.output_token_ids


def test_choice_constraint(tiny_model):
    from batchinfer.structured.base import Constraint

    engine = make_engine(tiny_model)
    options = ["yes", "no", "maybe"]
    reqs = [
        Request(f"c{i}", [5 + i, 9, 11], SamplingParams(max_tokens=20, temperature=1.0, seed=i), Constraint.choice(options))
        for i in range(3)
    ]
    reqs.append(Request("bad", [5], SamplingParams(max_tokens=5), Constraint.regex("(unclosed")))
    results = {r.request_id: r for r in engine.generate(reqs)}
    for i in range(3):
        r = results[f"c{i}"]
        assert r.finish_reason == "stop" and r.text in options, (r.text, r.error)
    assert results["bad"].finish_reason == "error" and "constraint" in results["bad"].error


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_respected(tiny_model, max_tokens):
    engine = make_engine(tiny_model)
    (r,) = engine.generate([Request("m", [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))])
    assert r.completion_tokens == max_tokens == len(r.output_token_ids) and r.finish_reason == "length"


def test_kv_cache_sized_from_the_cpu_budget(tiny_model):
    from batchinfer.engine.kv_cache import kv_block_bytes

    engine = make_engine(tiny_model, num_kv_blocks=None, kv_cache_gib=0.001, block_size=8)
    i = engine.model_info
    per_block = kv_block_bytes(i.num_layers, 8, i.num_kv_heads, i.head_dim, i.dtype)
    assert engine.runner.num_blocks == int(0.001 * (1 << 30)) // per_block == engine.allocator.num_blocks
    k, v = engine.runner.kv_caches[0]
    assert k.shape == (engine.runner.num_blocks, 8, i.num_kv_heads, i.head_dim) and len(engine.runner.kv_caches) == i.num_layers
    # A large budget is capped at what max_num_seqs sequences of max_model_len can use.
    capped = make_engine(tiny_model, num_kv_blocks=None, kv_cache_gib=64.0, max_num_seqs=2, max_model_len=64)
    assert capped.runner.num_blocks == 2 * 64 // 8


@pytest.mark.parametrize(
    "config",
    [
        dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=8, max_num_seqs=3),
        dict(num_kv_blocks=40, block_size=2, max_num_batched_tokens=50, max_num_seqs=6, enable_prefix_sharing=False),
        dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16, max_num_seqs=4),
    ],
)
def test_outputs_do_not_depend_on_cache_budget_or_batching(tiny_model, config):
    """A roomy engine and a cramped one (chunking, preemption, sharing or not) give the same tokens."""
    rng = random.Random(4)
    prefix = rand_prompt(rng, 16)
    prompts = [rand_prompt(rng, rng.randint(1, 30)) for _ in range(5)] + [prefix + rand_prompt(rng, k) for k in (0, 3, 9)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 14), temperature=rng.choice([0.0, 0.7]), seed=i, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    roomy = {r.request_id: r for r in make_engine(tiny_model, num_kv_blocks=400).generate(reqs)}
    cramped_engine = make_engine(tiny_model, **config)
    cramped_engine.scheduler.config = replace(cramped_engine.scheduler.config, max_reserved_output=1)
    cramped = list(cramped_engine.generate(reqs))
    assert sorted(r.request_id for r in cramped) == sorted(roomy)
    for r in cramped:
        assert r.output_token_ids == roomy[r.request_id].output_token_ids, r.request_id
        assert r.finish_reason == roomy[r.request_id].finish_reason
    cramped_engine.allocator.check()
    assert cramped_engine.allocator.num_used == 0


def test_profile_step_runs_the_largest_step(tiny_model):
    """The GPU sizing forward (device-agnostic part) builds a valid max-size batch."""
    engine = make_engine(tiny_model, max_num_batched_tokens=45, max_model_len=32, max_num_seqs=5)
    tokens = engine.runner.profile_step()
    assert tokens.shape == (5,) and int(tokens.max()) < engine.model_info.vocab_size
