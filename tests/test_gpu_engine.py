"""The engine on a GPU: CUDA-graph decode steps against eager ones, parity with transformers, engines
built one after another in one process, and the KV sizing's activation estimate.

Skipped without CUDA (conftest marks `gpu` tests). Small random demo models keep them fast.
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace

import pytest
import torch

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

pytestmark = pytest.mark.gpu


def _engine(path, dtype: str, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 40)
    kw.setdefault("num_kv_blocks", 512)
    return Engine(EngineConfig(model=str(path), dtype=dtype, device="cuda", attention_backend="triton", **kw))


def _requests(n: int, vocab: int, max_tokens: int = 24, seed: int = 0, **sampling) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            [rng.randrange(3, min(vocab, 500)) for _ in range(rng.randint(3, 70))],
            SamplingParams(max_tokens=rng.randint(4, max_tokens), ignore_eos=True, **sampling),
        )
        for i in range(n)
    ]


def _count_wide_replays(graphs, seqs: int) -> list[int]:
    """Wrap graphs.run (mixed-step or verify graphs): the list that collects the sampled rows of each
    replay sampling more rows than `seqs` sequences can without drafts (a verify step's)."""
    wide: list[int] = []
    real = graphs.run

    def run(ids, positions, meta, sample_index):
        if sample_index.shape[0] > seqs:
            wide.append(sample_index.shape[0])
        return real(ids, positions, meta, sample_index)

    graphs.run = run
    return wide


def _compare_graph_steps_with_eager(runner, attr: str, uses) -> list[float]:
    """Wrap runner.forward: every step for which uses(batch) holds also runs eagerly (runner.<attr>
    set to None for it) first; returns the list that collects each such step's max relative logit
    difference. KV writes are idempotent: the graph writes the same K/V again."""
    diffs: list[float] = []
    forward = runner.forward

    def both(batch):
        if not uses(batch):
            return forward(batch)
        graphs = getattr(runner, attr)
        setattr(runner, attr, None)
        eager = forward(batch).clone()
        setattr(runner, attr, graphs)
        out = forward(batch)
        diffs.append(((out - eager).abs().max() / eager.abs().max().clamp(min=1e-6)).item())
        return out

    runner.forward = both
    return diffs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_on_every_decode_step(tiny_model, dtype):
    """Each decode step's graph logits are compared with an eager forward of the same inputs. Every
    decode step, down to the last few rows, replays the one graph of max_num_seqs rows (40)."""
    engine = _engine(tiny_model, dtype)
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.sizes == (40,) and list(runner.graphs.graphs) == [40]
    diffs = _compare_graph_steps_with_eager(runner, "graphs", runner._uses_decode_graph)
    reqs = _requests(37, runner.vocab_size, temperature=0.0)
    results = list(engine.generate(reqs))
    assert len(results) == 37 and all(r.finish_reason == "length" for r in results)
    assert len(diffs) > 10
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    assert max(diffs) < tolerance, max(diffs)
    assert runner.graphs.captured_on_use == []


def test_a_decode_size_captured_on_first_use_replays_like_eager(tiny_model):
    """Above 256 rows the decode ladder has more than one size (256, 300): start-up captures 300, and
    the first decode step of 256 rows or fewer captures the 256-row graph mid-run (float32)."""
    engine = _engine(tiny_model, "float32", max_num_seqs=300, num_kv_blocks=4096)
    runner = engine.runner
    assert runner.graphs.sizes == (256, 300) and list(runner.graphs.graphs) == [300]
    diffs = _compare_graph_steps_with_eager(runner, "graphs", runner._uses_decode_graph)
    reqs = _requests(290, runner.vocab_size, temperature=0.0)
    results = list(engine.generate(reqs))
    assert len(results) == 290 and runner.graphs.captured_on_use == [256]
    assert len(diffs) > 10 and max(diffs) < 1e-4, max(diffs)
    engine.allocator.check()


def test_graphs_on_and_off_give_the_same_sampled_tokens(tiny_model):
    """float32, seeded sampling: graph steps and eager steps draw the same tokens."""
    outs = []
    for graphs in (True, False):
        engine = _engine(tiny_model, "float32", cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        reqs = _requests(21, engine.runner.vocab_size, temperature=0.8, seed=3)
        outs.append({r.request_id: r.output_token_ids for r in engine.generate(reqs)})
    same = sum(outs[0][k] == outs[1][k] for k in outs[0])
    assert same >= 20, f"only {same}/21 requests identical"


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_head_major_kv_cache_gives_the_token_major_tokens(tiny_model, kv_dtype):
    """float32, greedy, graphs on, prefix sharing on: kv_cache_layout head and token give the same
    tokens (the same values in the cache, read in another order), FP8 cache too."""
    outs = []
    for layout in ("token", "head"):
        engine = _engine(tiny_model, "float32", kv_cache_layout=layout, kv_cache_dtype=kv_dtype, enable_prefix_sharing=True)
        assert engine.runner.kv_layout == layout
        reqs = _requests(21, engine.runner.vocab_size, seed=4)
        reqs += [Request(f"p{i}", reqs[0].prompt_token_ids * 2, reqs[0].sampling) for i in range(3)]  # shared prefixes
        outs.append({r.request_id: r.output_token_ids for r in engine.generate(reqs)})
        del engine
        gc.collect()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_argmax_under_transformers(tiny_model, dtype):
    """Teacher-forced check of the GPU engine's greedy output against transformers in float32:
    every chosen token's reference logit is within tolerance of the reference maximum."""
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model, dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval().cuda()
    reqs = _requests(12, engine.runner.vocab_size, max_tokens=16, seed=5, temperature=0.0)
    tolerance = 1e-3 if dtype == "float32" else 0.15
    for r in engine.generate(reqs):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(r.prompt_token_ids) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(r.output_token_ids, device="cuda")[:, None])[:, 0]
        gap = (logits.max(dim=1).values - chosen).max().item()
        assert gap <= tolerance * max(1.0, logits.abs().max().item()), (r.request_id, gap)


@pytest.mark.parametrize("graphs", [True, False])
def test_overlap_on_and_off_give_the_same_tokens(tiny_model, graphs):
    """float32, seeded sampling, early stops by token id (wasted rows in the overlapped loop): the
    one-step lookahead draws the same tokens as the serial loop and frees every block."""
    outs, stats = [], []
    for overlap in (False, True):
        steps: list = []
        engine = _engine(tiny_model, "float32", cuda_graphs=graphs, overlap=overlap)
        engine.on_step = steps.append
        reqs = _requests(37, engine.runner.vocab_size, temperature=0.8, seed=7)
        reqs += [
            Request(f"s{i}", r.prompt_token_ids, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(i % 50 + 3,)))
            for i, r in enumerate(reqs[:10])
        ]
        results = list(engine.generate(reqs))
        assert len({r.request_id for r in results}) == len(results) == 47
        engine.allocator.check()
        assert engine.allocator.num_used == 0
        outs.append({r.request_id: r.output_token_ids for r in results})
        stats.append(steps)
    same = sum(outs[0][k] == outs[1][k] for k in outs[0])
    assert same >= 45, f"only {same}/47 requests identical"
    for steps in stats:  # schedule_ms on a GPU: measured idle gaps of the device (timing events)
        assert all(0 <= s.schedule_ms and 0 <= s.wait_ms <= s.step_ms for s in steps)


def test_no_kernel_compiles_after_the_first_run(tiny_model):
    """Once one small run has gone through (start-up captured the decode graphs and warmed the
    sampler), a second run with other prompt lengths, batch mixes and sampling compiles no Triton
    kernel: step inputs are 16-byte aligned and per-step integers are not specialised on, so the
    shapes of a step never show up in a kernel's signature (a compile costs ~1 s mid-run)."""
    from batchinfer.kernels.jit_stats import compiled_since, compiled_variants

    engine = _engine(tiny_model, "bfloat16")
    vocab = engine.model_info.vocab_size
    list(engine.generate(_requests(6, vocab, seed=1)))
    before = compiled_variants()
    sampled = [replace(r, request_id=f"t{r.request_id}") for r in _requests(5, vocab, seed=3, temperature=1.0)]
    reqs = _requests(37, vocab, max_tokens=30, seed=2, temperature=0.0) + sampled
    results = list(engine.generate(reqs))
    assert len(results) == len(reqs) and all(r.finish_reason == "length" for r in results)
    assert compiled_since(before) == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_graph_replay_equals_eager_on_every_mixed_step(tiny_model, dtype):
    """Steps that prefill (chunks, with decode rows) replay a mixed-step graph; each one's logits
    are compared with an eager forward of the same inputs. A small token budget makes many
    chunked, mixed steps of different padded sizes. Start-up captured the largest size only; the
    smaller ones are captured when a step first needs them, mid-run, and replay like the rest."""
    engine = _engine(tiny_model, dtype, max_num_batched_tokens=300)
    runner = engine.runner
    assert runner.mixed_graphs is not None and runner.mixed_graphs.sizes == (128, 256, 300)
    assert list(runner.mixed_graphs.graphs) == [300] and runner.mixed_graphs.captured_on_use == []
    diffs = _compare_graph_steps_with_eager(runner, "mixed_graphs", runner._uses_mixed_graph)
    reqs = _requests(37, runner.vocab_size, temperature=0.0)
    results = list(engine.generate(reqs))
    assert len(results) == 37 and all(r.finish_reason == "length" for r in results)
    assert len(diffs) >= 5
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    assert max(diffs) < tolerance, max(diffs)
    on_use = runner.mixed_graphs.captured_on_use
    assert on_use and sorted(set(on_use)) == sorted(on_use) and set(on_use) <= {128, 256}, on_use


def test_mixed_graphs_on_and_off_give_the_same_tokens(tiny_model):
    """float32, seeded sampling, chunked prefill: mixed-step graphs draw what eager steps draw."""
    outs = []
    for max_tokens in (512, 0):
        engine = _engine(tiny_model, "float32", max_num_batched_tokens=512, cuda_graph_max_tokens=max_tokens)
        assert (engine.runner.mixed_graphs is not None) == bool(max_tokens)
        reqs = _requests(29, engine.runner.vocab_size, temperature=0.8, seed=4)
        outs.append({r.request_id: r.output_token_ids for r in engine.generate(reqs)})
        engine.allocator.check()
    same = sum(outs[0][k] == outs[1][k] for k in outs[0])
    assert same >= 27, f"only {same}/29 requests identical"


def _settled_allocated() -> int:
    """CUDA memory allocated once every dead object is collected and the cache emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def test_engines_built_used_and_dropped_one_after_another_give_their_memory_back(tiny_model):
    """A notebook, an Airflow task or a reused Ray actor builds engine after engine in one process
    (batchinfer.run twice). Each of three engines, with decode and mixed-step graphs, captures, runs
    the same requests to the same tokens, and once closed (the second) or dropped (the others)
    leaves the CUDA memory allocated where it was before it. The second engine of a process used to
    fail its mixed-graph capture ("operation failed due to a previous error during capture")."""
    warm = _engine(tiny_model, "float32", max_num_batched_tokens=512)  # process-wide state: cuBLAS
    vocab = warm.runner.vocab_size  # workspaces per stream, compiled kernels; not an engine's own
    reqs = _requests(23, vocab, temperature=0.8, seed=11) + _requests(6, vocab, seed=12, temperature=0.0)
    reqs = [replace(r, request_id=f"{i}-{r.request_id}") for i, r in enumerate(reqs)]
    list(warm.generate(reqs[:4]))
    del warm
    start = _settled_allocated()
    outs = []
    for i in range(3):
        engine = _engine(tiny_model, "float32", num_kv_blocks=4096, max_num_batched_tokens=512)
        runner = engine.runner
        assert runner.graphs is not None and runner.mixed_graphs is not None
        outs.append({r.request_id: r.output_token_ids for r in engine.generate(reqs)})
        assert len(outs[-1]) == len(reqs)
        held = torch.cuda.memory_allocated() - start
        assert held >= 4096 * 16 * 2 * 2 * 2 * 32 * 4, held  # at least its KV cache (2 layers, fp32)
        if i == 1:
            engine.close()  # released while the object is still referenced
            assert runner.graphs is None and runner.kv_caches == []
            assert _settled_allocated() - start <= 2 << 20, (i, held)
        del engine, runner
        after = _settled_allocated()
        assert after - start <= 2 << 20, (i, held, after - start)
    assert outs[0] == outs[1] == outs[2]


def test_activation_estimate_is_near_the_profiled_peak(tmp_path):
    """engine/kv_budget.py: `plan`'s estimate of the largest step's activations, against what the
    runner measures on the device for a real shape (random weights)."""
    from batchinfer.bench.shapes import write_shape
    from batchinfer.engine import kv_budget
    from batchinfer.engine.model_runner import ModelRunner

    folder = write_shape("qwen3-0.6b", tmp_path / "qwen3-0.6b")
    cfg = EngineConfig(
        model=str(folder), dtype="bfloat16", device="cuda", load_format="random", cuda_graphs=False,
        max_model_len=2048, kv_cache_memory_fraction=0.1,
    )
    runner = ModelRunner(cfg)
    measured = runner.activation_peak_bytes
    estimate = kv_budget.estimate_activation_bytes(cfg, runner.info)
    assert 0.5 * measured <= estimate <= 2.0 * measured, (estimate, measured)
    runner.close()


def test_a_repeat_start_reads_the_step_profile_instead_of_profiling(tmp_path, monkeypatch):
    """engine/step_profile_cache.py: the first start profiles and stores what it measured; a second start
    with the same key reads it back (no profiling forward) and sizes the KV cache within 2% of the
    first; step_profile_cache False profiles again."""
    from batchinfer.bench.shapes import write_shape
    from batchinfer.engine.model_runner import ModelRunner

    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    folder = write_shape("qwen3-0.6b", tmp_path / "qwen3-0.6b")
    cfg = EngineConfig(
        model=str(folder), dtype="bfloat16", device="cuda", load_format="random", cuda_graphs=False,
        max_model_len=2048, kv_cache_memory_fraction=0.1,
    )
    first = ModelRunner(cfg)
    blocks, peak = first.num_blocks, first.activation_peak_bytes
    assert not first.step_profile_cached
    first.close()
    del first
    gc.collect()
    torch.cuda.empty_cache()
    stored = list((tmp_path / "cache" / "step-profiles").glob("*.json"))
    assert len(stored) == 1

    def no_profiling(self):
        raise AssertionError("profiled although a stored profile matches")

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "profile_step", no_profiling)
        second = ModelRunner(cfg)
    assert second.step_profile_cached and second.activation_peak_bytes == peak
    assert abs(second.num_blocks - blocks) <= 0.02 * blocks, (second.num_blocks, blocks)
    second.close()
    del second
    gc.collect()
    torch.cuda.empty_cache()
    third = ModelRunner(replace(cfg, step_profile_cache=False))
    assert not third.step_profile_cached
    third.close()


def test_an_engine_built_after_another_was_closed_gets_as_large_a_kv_cache(tmp_path, monkeypatch):
    """A process that builds an engine after closing another (the bench's oracle recording run, a
    notebook, a reused worker): the closed one's memory counts as free again, with the step profile
    read back from the first start and with profiling alike. No gc or empty_cache by the caller: the
    first engine is still referenced."""
    from batchinfer.bench.shapes import write_shape

    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    folder = write_shape("qwen3-0.6b", tmp_path / "qwen3-0.6b")
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", device="cuda", load_format="random", cuda_graphs=False,
                       max_model_len=2048, kv_cache_memory_fraction=0.5)
    first = Engine(cfg)
    blocks = first.runner.num_blocks
    first.close()
    second = Engine(cfg)
    assert second.runner.step_profile_cached
    assert abs(second.runner.num_blocks - blocks) <= 0.02 * blocks, (second.runner.num_blocks, blocks)
    second.close()
    third = Engine(replace(cfg, step_profile_cache=False))
    assert abs(third.runner.num_blocks - blocks) <= 0.02 * blocks, (third.runner.num_blocks, blocks)
    third.close()


@pytest.mark.parametrize("lanes", [False, True], ids=["serial", "lanes"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("prefill_first", [False, True], ids=["drafts-first", "prefill-first"])
def test_speculative_oracle_drafts_give_the_same_tokens(tiny_model, graphs, lanes, prefill_first):
    """Speculative decoding on the GPU (float32, triton attention, mixed-step graphs on or off, verify
    steps serial or in two lanes, one lane's step queued behind the other's): drafts from a plain run's
    output, 30% corrupted, verified in one forward; greedy and seeded sampling give the plain run's
    tokens; no KV block leaks. Verify steps replay graphs: the wide mixed graphs where drafts may sit
    beside prefill (drafts first), else graphs of their own (prefill first, lanes draining)."""
    from batchinfer.bench.oracle import oracle_drafter

    reqs = _requests(24, 500, max_tokens=30, temperature=0.0) + [
        Request(f"s{i}", r.prompt_token_ids, replace(r.sampling, temperature=0.9, seed=i))
        for i, r in enumerate(_requests(16, 500, max_tokens=30, seed=1))
    ]
    plain = {r.request_id: r.output_token_ids for r in _engine(tiny_model, "float32", cuda_graphs=graphs).generate(reqs)}
    steps: list = []
    engine = Engine(
        EngineConfig(model=str(tiny_model), dtype="float32", device="cuda", attention_backend="triton", max_num_seqs=40,
                     num_kv_blocks=512, cuda_graphs=graphs,
                     speculative={"num_tokens": 4, "lanes": lanes, "prefill_first": prefill_first}),
        on_step=steps.append, drafter=oracle_drafter(plain, 0.3, 500),
    )
    counts: list[list[int]] = []
    if graphs:
        runner = engine.runner
        assert (runner.verify_graphs is None) == (not prefill_first), "verify graphs captured beside wide mixed graphs"
        counts = [_count_wide_replays(g, 40) for g in (runner.mixed_graphs, runner.verify_graphs) if g is not None]
    spec = {r.request_id: r.output_token_ids for r in engine.generate(reqs)}
    replays = [n for c in counts for n in c]  # rows sampled by graph replays with more rows than sequences: verify steps
    assert spec == plain
    assert engine.verify_lanes is lanes
    assert bool(replays) == graphs, replays
    assert sum(s.spec_accepted for s in steps) > 0
    # a verify step's device idle gaps are measured by CUDA events (not its host time, which in lanes
    # mostly runs under the other lane's step)
    verify = [s for s in steps if s.spec_verified]
    assert verify and all(s.schedule_ms != s.host_ms for s in verify), [(s.schedule_ms, s.host_ms) for s in verify[:5]]
    engine.allocator.check()
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("drain", [False, True], ids=["lanes-carry", "lanes-drain"])
def test_lane_steps_carrying_prefill_replay_mixed_graphs(tiny_model, drain):
    """Drafts before prompts (the default) or speculative.lanes_drain off: lane steps carry prefill
    chunks beside their verify rows. Mixed-step graphs then gather every running sequence's k+1 rows
    (model_runner._mixed_graph_samples), so such a step replays a graph instead of running eagerly;
    the tokens stay the plain run's."""
    from batchinfer.bench.oracle import oracle_drafter

    reqs = _requests(32, 500, max_tokens=30, temperature=0.0)
    plain = {r.request_id: r.output_token_ids for r in _engine(tiny_model, "float32").generate(reqs)}
    steps: list = []
    engine = Engine(
        EngineConfig(model=str(tiny_model), dtype="float32", device="cuda", attention_backend="triton", max_num_seqs=16,
                     max_num_batched_tokens=256, num_kv_blocks=512,
                     speculative={"num_tokens": 4, "lanes": True, "lanes_drain": drain}),
        on_step=steps.append, drafter=oracle_drafter(plain, 0.3, 500),
    )
    mixed = engine.runner.mixed_graphs
    assert mixed is not None and mixed.max_num_seqs == min(256, 16 * 5)
    wide = _count_wide_replays(mixed, 16)
    spec = {r.request_id: r.output_token_ids for r in engine.generate(reqs)}
    assert spec == plain
    assert wide, "no lane step with prefill and drafts replayed a mixed graph"
    assert any(s.num_prefill_tokens and s.spec_verified for s in steps)
    engine.allocator.check()
    assert engine.allocator.num_used == 0


def test_shared_grammar_masks_give_the_per_row_tokens_on_the_gpu(tiny_model):
    """Grammar masks reach the sampler as distinct masks and a row index (RowMasks), gathered on the
    GPU: greedy and sampled JSON and regex answers equal those of one fill per row."""
    from batchinfer.structured.base import Constraint

    cs = [Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                                                   "b": {"type": "integer"}}, "required": ["a", "b"]}),
          Constraint.regex(r"[A-Z]{2}-[0-9]{3}( [a-z]{1,6}){0,4}")]
    reqs = [Request(f"r{i}", [5 + i, 40, 77], SamplingParams(max_tokens=40, temperature=0.0 if i % 3 else 1.0, seed=i),
                    cs[i % 2]) for i in range(32)]
    outs = {}
    for share in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cuda", max_num_seqs=16,
                                     num_kv_blocks=256, block_size=8, grammar_share_masks=share))
        outs[share] = {r.request_id: (r.finish_reason, r.output_token_ids) for r in engine.generate(reqs)}
        if share:
            assert engine.grammar.rows_copied + engine.grammar.rows_cached > 0
    assert outs[True] == outs[False]


@pytest.mark.parametrize("lanes", [False, True], ids=["serial", "lanes"])
@pytest.mark.parametrize("method", ["grammar", "ngram+grammar"])
def test_speculative_with_a_schema_gives_the_same_tokens(tiny_model, method, lanes):
    """Speculative decoding under JSON schemas and a regex on the GPU (graphs on): grammar-forced drafts
    (and oracle drafts in place of n-grams, 30% corrupted) give the plain run's tokens, greedy and
    seeded; the answers that stop are valid; every verify step's masks reach the device from pinned
    memory (a copy from pageable memory waits for the device's queue: BENCHMARKS twenty-second session)."""
    from batchinfer.bench.oracle import oracle_drafter
    from batchinfer.structured.base import Constraint
    from batchinfer.structured.bitmask import RowMasks
    from batchinfer.structured.validate import validate_output

    cs = [Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                                   "year": {"type": "integer"},
                                                                   "kind": {"enum": ["paper", "report", "letter"]}},
                                  "required": ["name", "year", "kind"]}),
          Constraint.regex(r"[A-Z]{2}-[0-9]{3}( [a-z]{1,6}){0,3}")]
    reqs = [Request(f"r{i}", [5 + i, 40, 77, 3 + i % 7], SamplingParams(max_tokens=48, temperature=0.0 if i % 3 else 0.9,
                                                                         seed=i), cs[i % 2]) for i in range(24)]
    plain = {r.request_id: r for r in _engine(tiny_model, "float32", max_num_seqs=16).generate(reqs)}
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    engine = Engine(
        EngineConfig(model=str(tiny_model), dtype="float32", device="cuda", attention_backend="triton", max_num_seqs=16,
                     num_kv_blocks=512, speculative={"method": method, "num_tokens": 4, "lanes": lanes}),
        on_step=steps.append, drafter=oracle_drafter(truth, 0.3, 500) if method != "grammar" else None,
    )
    pinned: list[bool] = []
    sample_tokens = engine.runner.sample_tokens

    def checked(logits, sampling, bans=None, bitmask=None, steps=None, widths=None):
        if isinstance(bitmask, RowMasks) and widths is not None:
            pinned.append(bitmask.table.is_pinned() and bitmask.index.is_pinned())
        return sample_tokens(logits, sampling, bans, bitmask, steps, widths)

    engine.runner.sample_tokens = checked
    spec = {r.request_id: r for r in engine.generate(reqs)}
    assert {k: v.output_token_ids for k, v in spec.items()} == truth
    assert sum(s.spec_accepted for s in steps) > 0, "no draft accepted"
    assert pinned and all(pinned), pinned
    by_id = {r.request_id: r for r in reqs}
    stops = [rid for rid, r in spec.items() if r.finish_reason == "stop"]
    assert stops
    for rid in stops:
        assert validate_output(by_id[rid].constraint, spec[rid].text)[1] is None, (rid, spec[rid].text)
    engine.allocator.check()
    assert engine.allocator.num_used == 0
