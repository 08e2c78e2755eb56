"""Observability (CPU): records and report totals vs the output, resume, metrics over HTTP, token ids, traces.

The StepStats / Result streams come from `simulate`, a small discrete-event model of continuous
batching (admission, one-step prefill, one token per decode step, KV blocks of 16 tokens), so the
numbers the report computes can be checked against the ones the simulation knows.
"""

from __future__ import annotations

import json
import math
import random
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.engine.request import RequestTimes, Result
from batchinfer.engine.stats import StepStats
from batchinfer.io.manifest import Manifest, PartInfo
from batchinfer.observe import ObserveOptions, Observer, read_token_ids, report_command, row_metrics
from batchinfer.io import layout
from batchinfer.observe.records import part_paths
from batchinfer.observe.report import _dist, error_kind
from batchinfer.observe.trace import StepTracer, TraceConfig

BLOCK = 16


@dataclass
class Sim:
    """What a simulated run produced: the events in order, and the truth to check against."""

    events: list[tuple[str, object]]  # ("step", StepStats) | ("result", (row_id, Result))
    results: dict[str, Result]
    duration: float


def simulate(n_rows: int, start: float, seed: int = 0, max_running: int = 6, total_blocks: int = 64,
             error_every: int = 9, ids: list[str] | None = None) -> Sim:
    """Continuous batching in miniature; every `error_every`-th row is rejected as too long."""
    rng = random.Random(seed)
    ids = ids or [f"r{i}" for i in range(n_rows)]
    waiting = [
        {"id": rid, "prompt": rng.randint(3, 40), "max": rng.randint(1, 12), "out": 0, "arrived": start}
        for rid in ids
    ]
    running: list[dict] = []
    events: list[tuple[str, object]] = []
    results: dict[str, Result] = {}
    now, step = start, 0
    while waiting or running:
        step += 1
        step_ms = rng.uniform(5, 20)
        sched_ms = step_ms * 0.1
        finished_now: list[dict] = []
        prefill = decode = 0
        for r in running:
            r["out"] += 1
            decode += 1
        while waiting and len(running) < max_running:
            r = waiting.pop(0)
            if error_every and int(r["id"].lstrip("r")) % error_every == error_every - 1:
                res = Result(r["id"], [1] * 3000, [], "", "error", 3000, 0,
                             error="prompt too long: 3000 tokens > max_model_len 2048",
                             times=RequestTimes(arrived=r["arrived"], finished=now))
                results[r["id"]] = res
                events.append(("result", (r["id"], res)))
                continue
            r["scheduled"] = now
            prefill += r["prompt"]
            r["out"] = 1
            r["first"] = now + step_ms / 1000
            running.append(r)
        now += step_ms / 1000
        for r in list(running):
            if r["out"] >= r["max"]:
                running.remove(r)
                finished_now.append(r)
        used = sum(math.ceil((r["prompt"] + r["out"]) / BLOCK) for r in running)
        events.append(("step", StepStats(step, now, len(running), len(waiting), prefill, decode, used,
                                         total_blocks - used, 0, sched_ms, step_ms, len(finished_now))))
        for r in finished_now:
            res = Result(r["id"], list(range(r["prompt"])), list(range(r["out"])), "x" * r["out"],
                         "length" if r["out"] == r["max"] and r["max"] % 2 else "stop", r["prompt"], r["out"],
                         times=RequestTimes(r["arrived"], r["scheduled"], r["first"], now))
            results[r["id"]] = res
            events.append(("result", (r["id"], res)))
    return Sim(events, results, now - start)


def feed(obs: Observer, events) -> None:
    for kind, ev in events:
        if kind == "step":
            obs.on_step(ev)  # type: ignore[arg-type]
        else:
            obs.on_result(*ev)  # type: ignore[misc]


def commit_part(out: Path, manifest: Manifest, results: list[Result]) -> None:
    """What the job writer does: one Parquet part of (id, text, error) rows, then the manifest."""
    n = len(manifest.parts)
    table = pa.table({
        "id": [r.request_id for r in results],
        "text": [r.text for r in results],
        "error": [r.error for r in results],
    })
    name = f"part-{n:06d}.parquet"
    pq.write_table(table, str(out / name))
    manifest.add_part(PartInfo(name, table.num_rows, sum(r.error is not None for r in results)))


def test_row_metrics():
    r = Result("a", [1], [2], "", "stop", 1, 1, times=RequestTimes(10.0, 10.5, 11.0, 13.0))
    assert row_metrics(r) == {"queue_wait_s": 0.5, "ttft_s": 1.0, "decode_s": 2.0}
    r = Result("b", [1], [], "", "error", 1, 0, error="x", times=RequestTimes(10.0, finished=10.0))
    assert row_metrics(r) == {"queue_wait_s": None, "ttft_s": None, "decode_s": None}
    assert row_metrics(Result("c", [], [], "", "error", 0, 0))["ttft_s"] is None


def test_report_totals_equal_output(tmp_path):
    out = tmp_path / "out"
    obs = Observer(ObserveOptions(out_dir=out))
    sim = simulate(40, start=obs.t0 + 0.01)
    manifest = Manifest(out, fingerprint="fp123", id_column="id")
    manifest.save()
    batch: list[Result] = []
    for kind, ev in sim.events:
        feed(obs, [(kind, ev)])
        if kind == "result":
            batch.append(ev[1])  # type: ignore[index]
            if len(batch) == 7:
                commit_part(out, manifest, batch)
                batch = []
    commit_part(out, manifest, batch)
    report = obs.close({"config": {"model": "tiny", "max_num_seqs": 6}})
    assert report is not None
    saved = json.loads(layout.report_json_path(out).read_text())
    assert saved["totals"] == report["totals"]

    output = pl.read_parquet([str(p) for p in manifest.part_paths])
    t = saved["totals"]
    assert t["rows"] == output.height == 40
    assert t["errors"] == output.get_column("error").is_not_null().sum() == 40 // 9
    assert t["prompt_tokens"] == sum(r.prompt_tokens for r in sim.results.values())
    assert t["completion_tokens"] == sum(r.completion_tokens for r in sim.results.values())
    reasons: dict[str, int] = {}
    for r in sim.results.values():
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    assert t["finish_reasons"] == dict(sorted(reasons.items()))
    assert t["steps"] == sum(k == "step" for k, _ in sim.events)
    assert saved["output"]["matches_records"] and saved["output"]["rows"] == 40
    assert saved["fingerprint"] == "fp123"
    assert saved["config"] == {"model": "tiny", "max_num_seqs": 6}
    assert saved["versions"]["torch"] == torch.__version__ and saved["versions"]["python"]
    assert saved["errors_by_kind"]["prompt too long"]["count"] == 40 // 9
    assert saved["throughput"]["engine_s"] == pytest.approx(sim.duration, rel=1e-6)
    ttft = [row_metrics(r)["ttft_s"] for r in sim.results.values() if r.finish_reason != "error"]
    assert saved["latency_s"]["ttft"]["count"] == len(ttft)
    assert saved["latency_s"]["ttft"]["p90"] == pytest.approx(float(np.percentile(ttft, 90)))
    assert saved["kv"]["total_blocks"] == 64
    page = layout.report_html_path(out).read_text()
    assert page.count('src="data:image/png;base64,') == 5

    layout.report_html_path(out).delete()
    text = report_command(out)
    assert "rows 40 (ok 36, error 4)" in text
    assert layout.report_html_path(out).exists()
    again = json.loads(layout.report_json_path(out).read_text())
    assert again["totals"] == saved["totals"] and again["config"] == saved["config"]
    assert again["fingerprint"] == "fp123"


def test_resume_after_crash_counts_each_row_once(tmp_path):
    out = tmp_path / "out"
    ids = [f"r{i}" for i in range(30)]
    manifest = Manifest(out, fingerprint="fp", id_column="id")
    out.mkdir()
    manifest.save()
    # run 1 finishes 20 rows (records flushed every 4) but commits only the first 12, then dies
    obs1 = Observer(ObserveOptions(out_dir=out, flush_rows=4))
    sim1 = simulate(20, start=obs1.t0, ids=ids[:20], error_every=0)
    feed(obs1, sim1.events)
    done = [ev[1] for k, ev in sim1.events if k == "result"]
    commit_part(out, manifest, done[:12])  # type: ignore[arg-type]
    recorded = pl.read_parquet(part_paths(layout.rows_dir(out))).height
    assert 12 < recorded <= 20  # the dead run left rows that are not in the output
    # run 2 (resume) does the rest again
    left = [i for i in ids if i not in {r.request_id for r in done[:12]}]  # type: ignore[union-attr]
    obs2 = Observer(ObserveOptions(out_dir=out, flush_rows=3))
    sim2 = simulate(len(left), start=obs2.t0, ids=left, seed=1, error_every=0)
    feed(obs2, sim2.events)
    commit_part(out, manifest, [ev[1] for k, ev in sim2.events if k == "result"])  # type: ignore[misc]
    report = obs2.close()
    assert report is not None
    assert report["totals"]["rows"] == 30 == report["output"]["rows"]
    assert report["output"]["matches_records"]
    assert report["totals"]["runs"] == 2
    expect = sum(r.completion_tokens for r in done[:12]) + sum(r.completion_tokens for r in sim2.results.values())  # type: ignore[union-attr]
    assert report["totals"]["completion_tokens"] == expect
    steps = pl.read_parquet(part_paths(layout.steps_dir(out)))
    assert steps.get_column("run_id").n_unique() == 2
    for folder in (layout.steps_dir(out), layout.rows_dir(out)):  # close() merged run 2's small parts into one
        assert len([p for p in part_paths(folder) if obs2.run_id in p]) == 1
    assert steps.filter(pl.col("run_id") == obs2.run_id).height == sum(k == "step" for k, _ in sim2.events)


def test_report_without_manifest_and_missing_folder(tmp_path):
    out = tmp_path / "o"
    with Observer(ObserveOptions(out_dir=out)) as obs:
        feed(obs, simulate(5, start=obs.t0, error_every=0).events)
    saved = json.loads(layout.report_json_path(out).read_text())
    assert saved["totals"]["rows"] == 5 and saved["output"] is None
    with pytest.raises(FileNotFoundError, match="no such output folder"):
        report_command(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no run records"):
        report_command(tmp_path / "empty")


def test_failed_run_keeps_records_and_skips_report(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(RuntimeError):
        with Observer(ObserveOptions(out_dir=out)) as obs:
            feed(obs, simulate(5, start=obs.t0, error_every=0).events)
            raise RuntimeError("engine died")
    assert not layout.report_json_path(out).exists()
    assert pl.read_parquet(part_paths(layout.rows_dir(out))).height == 5
    assert "rows 5 " in report_command(out)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=60))
def test_percentiles_match_numpy(values):
    d = _dist(pl.DataFrame({"x": values + [None]}), "x")
    assert d["count"] == len(values)
    for q in (50, 90, 95, 99):
        assert d[f"p{q}"] == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)
    assert d["max"] == max(values)


def test_error_kind():
    assert error_kind("prompt too long: 3000 > 2048") == "prompt too long"
    assert error_kind(None) == "unknown"
    assert error_kind(": odd") == ": odd"


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_port_scrape_moves(tmp_path):
    textfile = tmp_path / "batchinfer.prom"
    obs = Observer(ObserveOptions(out_dir=tmp_path / "o", metrics_port=0, metrics_textfile=textfile))
    port = obs.metrics_port
    assert port and port > 0
    sim = simulate(30, start=obs.t0)
    half = len(sim.events) // 2
    feed(obs, sim.events[:half])
    first = _scrape(port)
    feed(obs, sim.events[half:])
    second = _scrape(port)

    def rows(s):
        return sum(v for (n, _), v in s.items() if n == "batchinfer_rows_total")

    n_first = sum(k == "result" for k, _ in sim.events[:half])
    assert rows(first) == n_first < rows(second) == 30
    assert second[("batchinfer_rows_total", (("finish_reason", "error"),))] == 30 // 9
    comp = ("batchinfer_tokens_total", (("kind", "completion"),))
    assert first[comp] < second[comp] == sum(r.completion_tokens for r in sim.results.values())
    assert second[("batchinfer_step_seconds_count", ())] == sum(k == "step" for k, _ in sim.events)
    last = [ev for k, ev in sim.events if k == "step"][-1]
    assert second[("batchinfer_kv_blocks_free", ())] == last.kv_blocks_free  # type: ignore[attr-defined]
    assert second[("batchinfer_ttft_seconds_count", ())] == 30 - 30 // 9
    obs.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)
    final = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(textfile.read_text()) for s in f.samples}
    assert final[comp] == second[comp]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_two_observers_have_separate_registries(tmp_path):
    a = Observer(ObserveOptions(out_dir=tmp_path / "a", metrics_textfile=tmp_path / "a.prom", report=False))
    b = Observer(ObserveOptions(out_dir=tmp_path / "b", metrics_textfile=tmp_path / "b.prom", report=False))
    feed(a, simulate(4, start=a.t0, error_every=0).events)
    a.close()
    b.close()
    assert 'batchinfer_rows_total{finish_reason="stop"}' in (tmp_path / "a.prom").read_text() or \
        'batchinfer_rows_total{finish_reason="length"}' in (tmp_path / "a.prom").read_text()
    assert "batchinfer_rows_total{" not in (tmp_path / "b.prom").read_text()


def test_bad_metrics_textfile_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--metrics-textfile .*m.prom: folder .*no does not exist"):
        Observer(ObserveOptions(out_dir=tmp_path / "o", metrics_textfile=tmp_path / "no" / "m.prom"))


def test_token_ids_decode_back_to_prompts(tmp_path):
    from batchinfer.demo import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    docs = ["the invoice total is 42", "café naïve 日本語 😀", '{"name": "x", "items": [1, 2]}', "", "Größe"]
    obs = Observer(ObserveOptions(out_dir=tmp_path / "o", log_token_ids=True))
    prompts, outputs = {}, {}
    for i, doc in enumerate(docs):
        prompt = tok.apply_chat_template([{"role": "user", "content": doc}], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        out_ids = tok(doc[::-1], add_special_tokens=False)["input_ids"]
        prompts[i], outputs[i] = prompt, doc[::-1]
        obs.on_result(i, Result(str(i), ids, out_ids, doc[::-1], "stop", len(ids), len(out_ids)))
    obs.close()
    part = part_paths(layout.token_ids_dir(tmp_path / "o"))[0]
    schema = pq.read_schema(part)
    assert schema.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert schema.field("output_token_ids").type == pa.list_(pa.int32())
    frame = read_token_ids(tmp_path / "o")
    assert frame.height == len(docs)
    for row in frame.iter_rows(named=True):
        i = int(row["id"])
        assert tok.decode(row["prompt_token_ids"], skip_special_tokens=False) == prompts[i]
        assert tok.decode(row["output_token_ids"]) == outputs[i]


def test_trace_records_the_window(tmp_path):
    tracer = StepTracer(TraceConfig(tmp_path / "trace", start_step=2, num_steps=2))
    a = torch.randn(32, 32)
    for step in range(1, 7):
        for _ in range(3):
            a = torch.tanh(a @ a)
        tracer.on_step(StepStats(step, 0.0, 1, 0, 0, 1, 1, 1, 0, 0.1, 1.0))
    path = tracer.close()
    assert path is not None and path.name == "trace-steps-3-4.json"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::mm" in names and "aten::tanh" in names
    assert (tmp_path / "trace" / "trace-steps-3-4.txt").read_text().strip()


def test_trace_window_cut_short_by_the_end_of_the_run(tmp_path):
    obs = Observer(ObserveOptions(out_dir=tmp_path / "o", trace_dir=tmp_path / "t", trace_start_step=1,
                                  trace_num_steps=50, report=False))
    feed(obs, simulate(3, start=obs.t0, error_every=0).events)
    obs.close()
    files = sorted(p.name for p in (tmp_path / "t").glob("*.json"))
    assert len(files) == 1 and files[0].startswith("trace-steps-2-")


def test_options_are_checked():
    with pytest.raises(ValueError, match="metrics_port"):
        ObserveOptions(out_dir=Path("x"), metrics_port=70000)
    with pytest.raises(ValueError, match="num_steps"):
        TraceConfig(Path("x"), num_steps=0)


@dataclass(frozen=True)
class DriverRecord:
    """The shape of run.RowRecord, with the `error` and `result` fields the wiring adds."""

    row_id: object
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    times: object = None
    num_preemptions: int = 0
    error: str | None = None
    result: Result | None = None


def test_driver_row_records_count_errors_as_the_output_does(tmp_path):
    out = tmp_path / "o"
    obs = Observer(ObserveOptions(out_dir=out, log_token_ids=True))
    t = RequestTimes(obs.t0, obs.t0 + 0.1, obs.t0 + 0.2, obs.t0 + 0.5)
    ok = Result("0", [5, 6, 7], [8, 9], "ab", "stop", 3, 2, times=t)
    cut = Result("1", [5, 6], [1, 2, 3], "{\"a", "length", 2, 3, times=t)
    records = [
        DriverRecord(10, "stop", 3, 2, t, 0, None, ok),
        DriverRecord(11, "length", 2, 3, t, 1, "output cut at max_tokens (3 tokens) before it matched: x", cut),
        DriverRecord(12, "error", 0, 0),  # the template failed: never reached the engine
    ]
    for r in records:
        obs.on_row(r)
    out_rows = [(str(r.row_id), r.error if r.finish_reason != "error" else "template: bad") for r in records]
    pq.write_table(pa.table({"id": [i for i, _ in out_rows], "error": [e for _, e in out_rows]}),
                   str(out / "part-000000.parquet"))
    Manifest(out, "fp", id_column="id", parts=[PartInfo("part-000000.parquet", 3, 2)]).save()
    report = obs.close()
    assert report is not None
    assert report["totals"]["errors"] == 2 and report["output"]["matches_records"]
    assert report["totals"]["finish_reasons"] == {"error": 1, "length": 1, "stop": 1}
    assert set(report["errors_by_kind"]) == {"output cut at max_tokens (3 tokens) before it matched", "unknown"}
    assert report["totals"]["row_preemptions"] == 1
    assert report["latency_s"]["row"]["count"] == 2
    assert sorted(read_token_ids(out).get_column("id").to_list()) == ["10", "11"]
    assert row_metrics(records[0]) == pytest.approx({"queue_wait_s": 0.1, "ttft_s": 0.2, "decode_s": 0.3})


def test_driver_row_record_type_is_accepted(tmp_path):
    from batchinfer.job.summary import RowRecord

    rec = RowRecord("x", "stop", 4, 2, RequestTimes(1.0, 1.0, 1.5, 2.0), 0)
    obs = Observer(ObserveOptions(out_dir=tmp_path / "o", metrics_textfile=tmp_path / "m.prom"))
    obs.on_row(rec)
    report = obs.close()
    assert report is not None and report["totals"]["rows"] == 1 and report["totals"]["completion_tokens"] == 2
    assert 'batchinfer_rows_total{finish_reason="stop"} 1.0' in (tmp_path / "m.prom").read_text()


def test_fresh_output_folder_drops_old_records(tmp_path):
    out = tmp_path / "o"
    with Observer(ObserveOptions(out_dir=out, log_token_ids=True)) as obs:
        feed(obs, simulate(6, start=obs.t0, error_every=0).events)
    assert layout.token_ids_dir(out).is_dir()
    with Observer(ObserveOptions(out_dir=out)) as obs:  # no committed part: a new job (e.g. --overwrite)
        feed(obs, simulate(2, start=obs.t0, error_every=0, ids=["new0", "new1"]).events)
    report = json.loads(layout.report_json_path(out).read_text())
    assert report["totals"]["rows"] == 2 and report["totals"]["runs"] == 1
    assert not layout.token_ids_dir(out).exists()


def test_busy_metrics_port_is_named(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"--metrics-port {port}"):
            Observer(ObserveOptions(out_dir=tmp_path / "o", metrics_port=port))


def test_report_json_and_textfile_are_written_before_the_page(tmp_path, monkeypatch):
    """What other tools read (report.json, the node-exporter textfile) does not wait for the plots, and
    survives a page that fails to draw."""
    from batchinfer.observe import observer as observer_module

    out, textfile, seen = tmp_path / "o", tmp_path / "m.prom", {}

    def page(out_dir, report, steps, rows):
        seen.update(json=layout.report_json_path(out_dir).exists(), textfile=textfile.exists(),
                    html=layout.report_html_path(out_dir).exists(), steps=steps.height, rows=rows.height)
        raise RuntimeError("no plots today")

    monkeypatch.setattr(observer_module, "write_report_page", page)
    obs = Observer(ObserveOptions(out_dir=out, metrics_textfile=textfile))
    sim = simulate(12, start=obs.t0)
    feed(obs, sim.events)
    with pytest.raises(RuntimeError, match="no plots today"):
        obs.close()
    assert seen["json"] and seen["textfile"] and not seen["html"] and seen["rows"] == 12 and seen["steps"] > 0
    assert json.loads(layout.report_json_path(out).read_text())["totals"]["rows"] == 12
    assert obs.report is not None and obs.report["totals"]["rows"] == 12
