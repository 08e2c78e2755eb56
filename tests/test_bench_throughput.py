"""`bench throughput` on the CPU: the per-step breakdown, the compile check, a whole small run."""

from __future__ import annotations

import pytest

from batchinfer.bench.report_text import format_report
from batchinfer.bench.step_breakdown import step_breakdown
from batchinfer.bench.throughput import run_throughput
from batchinfer.engine.stats import StepStats


def stats(step, prefill, decode, blocks, ms, idle=0.0, phases=None) -> StepStats:
    return StepStats(step=step, time=0.0, num_running=decode, num_waiting=0, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, kv_blocks_used=blocks, kv_blocks_free=0, num_preemptions=0,
                     schedule_ms=idle, step_ms=ms, phases_ms=phases or {})


def test_step_breakdown_groups_and_floors():
    steps = [
        stats(1, 100, 0, 10, 8.0, phases={"launch": 2.0}),
        stats(2, 0, 200, 50, 4.0, idle=1.0, phases={"launch": 1.0, "read_tokens": 2.0}),
        stats(3, 0, 250, 60, 6.0, idle=0.0, phases={"launch": 3.0}),
        stats(4, 0, 10, 5, 1.0),
        stats(5, 0, 0, 0, 0.1),  # only read the step in flight: a group of its own, no floor
    ]
    kw = dict(weight_bytes=1000, kv_bytes_per_token=10, block_size=4, flops_per_token=100.0, lm_head_flops=50.0,
              copy_bytes_per_s=1e6, matmul_flops_per_s=1e7)
    groups = {g["group"]: g for g in step_breakdown(steps, **kw)}
    assert set(groups) == {"prefill/mixed", "decode 193+ rows", "decode 1-16 rows", "reads only"}
    reads = groups["reads only"]
    assert reads["steps"] == 1 and reads["time_s"] == pytest.approx(1e-4) and reads["mean_floor_ms"] == 0.0
    assert reads["fraction_of_floor"] is None
    big = groups["decode 193+ rows"]
    assert big["steps"] == 2 and big["time_s"] == pytest.approx(0.010) and big["max_step_ms"] == 6.0
    # step 2: memory (1000 + 50*4*10) / 1e6 s = 3 ms, compute (200*100 + 200*50) / 1e7 s = 3 ms
    # step 3: memory (1000 + 60*4*10) / 1e6 = 3.4 ms, compute 250*150/1e7 = 3.75 ms
    assert big["mean_floor_ms"] == pytest.approx((3.0 + 3.75) / 2)
    assert big["fraction_of_floor"] == pytest.approx(6.75 / 10.0)
    assert big["mean_device_idle_ms"] == pytest.approx(0.5)
    assert big["mean_host_phases_ms"] == pytest.approx({"launch": 2.0, "read_tokens": 1.0})
    # prefill: compute 100*100/1e7 = 1 ms < memory (1000 + 40*10)/1e6 = 1.4 ms
    assert groups["prefill/mixed"]["mean_floor_ms"] == pytest.approx(1.4)
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0)
    assert big["mean_model_ms"] is None
    # with the step cost model: GEMMs max(1000 B / 1e6, T x 100 / 1e7) + LM head + decode attention
    from batchinfer.engine.step_cost import StepCost

    cost = StepCost(layer_flops_per_token=100.0, lm_head_flops_per_row=50.0, attn_flops_per_pair=0.0, weight_bytes=1000,
                    kv_bytes_per_token=10, copy_bytes_per_s=1e6, matmul_flops_per_s=1e7, layer_flops_per_s=1e7)
    modeled = {g["group"]: g for g in step_breakdown(steps, **kw, step_cost=cost)}
    # step 2: max(1 ms, 2 ms + 1 ms) + 200 KV tokens x 10 B / 1e6 = 5 ms; step 3: max(1, 2.5 + 1.25) + 2.4 = 6.15 ms
    assert modeled["decode 193+ rows"]["mean_model_ms"] == pytest.approx((5.0 + 6.15) / 2)
    assert modeled["reads only"]["mean_model_ms"] == 0.0


def test_step_breakdown_counts_a_verify_steps_drafts():
    """A verify step's drafts are tokens of the layers and rows of the LM head; its group is its sequences'."""
    from dataclasses import replace

    kw = dict(weight_bytes=1000, kv_bytes_per_token=10, block_size=4, flops_per_token=100.0, lm_head_flops=50.0,
              copy_bytes_per_s=1e6, matmul_flops_per_s=1e7)
    verify = replace(stats(1, 0, 10, 5, 4.0), num_draft_tokens=190)  # 10 sequences, 190 drafts
    (g,) = step_breakdown([verify], **kw)
    assert g["group"] == "decode 1-16 rows" and g["mean_tokens"] == 200
    # memory (1000 + 5*4*10) / 1e6 = 1.2 ms < compute 200 * (100 + 50) / 1e7 = 3 ms
    assert g["mean_floor_ms"] == pytest.approx(3.0)


def test_step_breakdown_reads_a_lane_steps_own_kv():
    """A step whose sequences cover fewer KV positions than the blocks in use (a lane's step, the
    other lane's KV untouched) is floored by its own; a plain step keeps the blocks in use."""
    from dataclasses import replace

    kw = dict(weight_bytes=1000, kv_bytes_per_token=10, block_size=4, flops_per_token=1.0, lm_head_flops=1.0,
              copy_bytes_per_s=1e6, matmul_flops_per_s=1e9)
    lane = replace(stats(1, 0, 100, 50, 4.0), num_context_tokens=80)  # blocks in use: 200 positions
    plain = replace(stats(2, 0, 200, 50, 4.0), num_context_tokens=260)  # a shared prefix, once per sequence
    groups = {g["group"]: g for g in step_breakdown([lane, plain], **kw)}
    assert groups["decode 65-128 rows"]["mean_floor_ms"] == pytest.approx((1000 + 80 * 10) / 1e3)
    assert groups["decode 193+ rows"]["mean_floor_ms"] == pytest.approx((1000 + 200 * 10) / 1e3)


def test_compiled_variants_counts_every_kernel_and_reports_only_growth():
    pytest.importorskip("triton")
    from batchinfer.kernels.jit_stats import compiled_since, compiled_variants

    counts = compiled_variants()
    assert "decode_attention._decode_split_kernel" in counts and "extend_attention._extend_kernel" in counts
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    assert compiled_since(counts) == {}
    assert compiled_since({k: n - 1 for k, n in counts.items() if n > 0}) == {k: 1 for k, n in counts.items() if n > 0}


def test_run_on_a_model_folder(tiny_model, tmp_path):
    r = run_throughput(str(tiny_model), "nano256", scale=0.02, cache_dir=tmp_path)
    assert r["errors"] == 0 and r["requests"] == 5
    assert r["output_tokens"] > 0 and 0 < r["fraction_of_roofline"]
    assert sum(g["steps"] for g in r["step_breakdown"]) <= r["steps"]
    assert {g["group"] for g in r["step_breakdown"]} >= {"prefill/mixed"}
    text = format_report(r)
    assert "% of the roofline" in text and "host ms per step in" in text


def test_cli_passes_engine_options_and_writes_json(tiny_model, tmp_path):
    import json

    import torch
    from typer.testing import CliRunner

    from batchinfer.cli import app

    out = tmp_path / "r.json"
    before = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, ["bench", "throughput", "--workload", "nano256", "--model", str(tiny_model),
                                       "--scale", "0.02", "--grammar-backend", "xgrammar", "--torch-threads", "1", "--grammar-threads", "3",
                                       "--set", "prefill_policy=slack", "--set", "slack_tolerance=1", "--out", str(out)])
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["engine"]["grammar_backend"] == "xgrammar" and r["engine"]["torch_threads"] == 1
    assert r["engine"]["grammar_threads"] == 3
    assert r["engine"]["prefill_policy"] == "slack" and r["engine"]["slack_tolerance"] == 1.0
    assert "of the roofline" in res.output and "prefill policy slack: held prefill back in" in res.output
    assert r["prefill_limited_steps"] >= 0


def test_cli_set_rejects_unknown_fields_and_wrong_types(tmp_path):
    from typer.testing import CliRunner

    from batchinfer.bench.cli import engine_sets
    from batchinfer.cli import app

    assert engine_sets(["prefill_policy=slack", "slack_max_idle_slots=4", "slack_tolerance=0"]) == {
        "prefill_policy": "slack", "slack_max_idle_slots": 4, "slack_tolerance": 0.0}
    for bad, msg in (("prefil_policy=slack", "not an EngineConfig field"), ("max_num_seqs=many", "expected int"),
                     ("cuda_graphs=3", "expected bool")):
        res = CliRunner().invoke(app, ["bench", "throughput", "--model", "qwen3-0.6b", "--set", bad, "--out", str(tmp_path / "x.json")])
        assert res.exit_code == 2 and msg in res.output, res.output


@pytest.mark.parametrize("lanes", [None, True])
def test_oracle_speculation_reports_acceptance(tiny_model, tmp_path, lanes):
    """--speculative oracle: drafts from a recorded plain run; uncorrupted they are all accepted.
    --spec-lanes: the report says how verify steps ran (default on the CPU: serially)."""
    r = run_throughput(str(tiny_model), "nano256", scale=0.02, cache_dir=tmp_path, speculative="oracle",
                       spec_tokens=3, oracle_corrupt=0.0, spec_lanes=lanes)
    sp = r["speculative"]
    assert sp["lanes"] is bool(lanes)
    assert ("two lanes" if lanes else "verify steps serial") in format_report(r)
    assert r["errors"] == 0 and sp["verified"] > 0 and sp["accepted"] == sp["verified"]
    assert sp["tokens_per_seq_per_forward"] > 1.5
    assert "tokens per sequence per forward" in format_report(r)
    # no grammar: every draft is the drafter's (reported as the oracle source)
    assert sp["sources"]["ngram"]["accepted"] == sp["accepted"] and sp["sources"]["forced"]["verified"] == 0
    assert "oracle drafts" in format_report(r)


def test_oracle_drafts_nothing_once_a_sequence_leaves_the_recording():
    """A measured run's output can differ from the recorded one (bf16 numerics of another batch): while a
    sequence's latest tokens differ from the recording, the oracle drafts nothing for it (it knows
    nothing of it), and it goes on drafting the recording for the others."""
    from types import SimpleNamespace

    from batchinfer.bench.oracle import oracle_drafter

    truth = {"a": [10, 11, 12, 13, 14, 15, 16], "b": [20, 21, 22, 23, 24]}
    draft = oracle_drafter(truth, 0.0, 100)

    def seq(rid, output):
        return SimpleNamespace(request=SimpleNamespace(request_id=rid), token_ids=[1, 2, *output], num_prompt_tokens=2,
                               num_generated=len(output))

    assert draft(seq("a", [10]), 3) == [11, 12, 13]
    assert draft(seq("b", [20, 21]), 2) == [22, 23]
    assert draft(seq("a", [10, 11, 99]), 3) == []  # left the recording at its third token
    assert draft(seq("a", [10, 11, 99, 13]), 3) == []  # and stays off while its latest tokens differ
    assert draft(seq("b", [20, 21, 22]), 5) == [23, 24]
    assert draft(seq("a", [10, 11, 12]), 2) == [13, 14]  # the same request run again (the bench's warm-up, then its run)


def test_plain_twin_runs_the_constrained_lengths_without_constraints(tiny_model, tmp_path):
    """--plain-twin: the same prompts unconstrained, each for exactly the tokens its constrained
    answer took; reported next to the constrained run (its share of the twin's output tok/s)."""
    from batchinfer.bench.throughput import plain_twin_requests
    from batchinfer.engine import Request, SamplingParams
    from batchinfer.engine.request import Result
    from batchinfer.structured.base import Constraint

    schema = Constraint.json_schema({"type": "object"})
    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.0), schema) for i in range(3)]
    results = [Result(f"r{i}", [5, 6, 7], [1] * n, "", "stop", 3, n) for i, n in ((2, 4), (0, 7), (1, 0))]
    twin = plain_twin_requests(reqs, results)
    assert [(q.request_id, q.sampling.max_tokens) for q in twin] == [("twin-r0", 7), ("twin-r2", 4)]  # r1 wrote nothing
    assert all(q.constraint is None and q.sampling.ignore_eos and q.prompt_token_ids == [5, 6, 7] for q in twin)

    r = run_throughput(str(tiny_model), "docs1000-json", scale=0.02, cache_dir=tmp_path, plain_twin=True)
    tw = r["plain_twin"]
    assert r["errors"] == 0 and tw["requests"] == r["requests"] and tw["output_tokens"] == r["output_tokens"] > 0
    assert tw["constrained_share"] == pytest.approx(r["output_tokens_per_s"] / tw["output_tokens_per_s"])  # no error rows here
    again = tw["constrained_again"]  # the constrained workload once more, after the twin, on the same engine
    assert again["output_tokens"] == r["output_tokens"]  # greedy: the same answers
    assert again["share"] == pytest.approx(again["output_tokens_per_s"] / tw["output_tokens_per_s"])
    assert "constrained again, after the twin" in format_report(r)
    assert "plain twin (the same prompts and output lengths" in format_report(r)
    assert run_throughput(str(tiny_model), "nano256", scale=0.02, cache_dir=tmp_path, plain_twin=True)["plain_twin"] is None


def test_graph_sizes_captured_mid_run_are_counted_and_reported(tiny_model, tmp_path):
    """The report says how many CUDA graph sizes a measured run captured on first use (each a
    capture inside that run's time; a plain twin run after it on the same engine finds them ready)."""
    from types import SimpleNamespace

    from batchinfer.bench.profile_window import graphs_captured_on_use

    runner = SimpleNamespace(graphs=SimpleNamespace(captured_on_use=[256, 64]), mixed_graphs=None,
                             verify_graphs=SimpleNamespace(captured_on_use=[512]))
    assert graphs_captured_on_use(runner) == 3
    r = run_throughput(str(tiny_model), "nano256", scale=0.02, cache_dir=tmp_path)
    assert r["graphs_captured_during_run"] == 0  # the CPU runs no graphs
    r["graphs_captured_during_run"] = 5
    assert "CUDA graph sizes captured on first use during the measured run: 5" in format_report(r)


def test_decode_only_rate_counts_emitted_tokens_of_verify_steps():
    """Issue 15's measure: output tokens of the decode-only steps over their time; a verify step
    counts the tokens it emitted (spec_emitted), a plain step one per decoding row, prefill steps
    and steps that only drained the one before none."""
    from dataclasses import replace

    from batchinfer.bench.step_breakdown import decode_only_rate

    plain = stats(1, 0, 200, 10, 5.0)
    verify = replace(stats(2, 0, 1000, 10, 10.0), spec_decode_rows=200, spec_emitted=700)
    mixed = stats(3, 300, 100, 10, 20.0)
    drained = stats(4, 0, 0, 10, 1.0)
    r = decode_only_rate([plain, verify, mixed, drained])
    assert r == {"steps": 2, "output_tokens": 900, "seconds": 0.015, "output_tokens_per_s": pytest.approx(60_000)}
    assert decode_only_rate([mixed]) is None


def test_plain_twin_leaves_the_constrained_runs_numbers_alone(tiny_model, tmp_path, monkeypatch):
    """The twin runs after the constrained run's report is made: the steps it records (into the same
    list) do not leak into that report's counts."""
    import batchinfer.bench.throughput as tp

    def fake_twin(engine, requests, results, steps, breakdown_of, rate, cuda):
        steps[:] = [stats(i, 0, 1, 1, 1.0) for i in range(99)]
        return {"step_breakdown": [], "elapsed_s": 1.0, "output_tokens_per_s": 1.0, "constrained_share": 1.0,
                "graphs_captured_during_run": 0}

    alone = run_throughput(str(tiny_model), "docs1000-json", scale=0.02, cache_dir=tmp_path)
    monkeypatch.setattr(tp, "_time_plain_twin", fake_twin)
    with_twin = run_throughput(str(tiny_model), "docs1000-json", scale=0.02, cache_dir=tmp_path, plain_twin=True)
    for key in ("steps", "decode_steps", "output_tokens", "prefill_limited_steps"):
        assert with_twin[key] == alone[key], key
    for key in ("steps", "output_tokens"):
        assert with_twin["decode_only"][key] == alone["decode_only"][key], key
