"""The run report a person reads, and two runs compared answer by answer (tiny random model, CPU).

Three real runs are made once for the module: a JSON-schema job (enum, boolean, nested object and
integer fields; a row that fails before the engine; a rejected input line), and two free-text runs
whose prompts differ only for the rows whose text holds a '7' (B also lacks one id and has one more).
The page is checked in headless Chromium where one is installed (apt-get install -y chromium).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import polars as pl
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from typer.testing import CliRunner

import batchinfer
from batchinfer.cli import app
from batchinfer.io import layout
from batchinfer.io.manifest import Manifest
from batchinfer.observe import ObserveOptions, Observer, labels, plots, read_token_ids, report_command
from batchinfer.observe import observer as observer_mod
from batchinfer.observe.answers import FieldSpec, field_stats, schema_fields
from batchinfer.observe.compare import compare_runs
from batchinfer.observe.records import ROW_SCHEMA, read_parts
from batchinfer.job import make_engine
from test_observe import commit_part, feed, simulate
from test_observe_page import CHROMIUM, PROBE

SCHEMA = {  # short names and values: the random model writes every character, one small token at a time
    "type": "object",
    "properties": {
        "kind": {"enum": ["inv", "ltr", "rep"]},
        "ok": {"type": "boolean"},
        "m": {
            "type": "object",
            "properties": {"lang": {"enum": ["en", "de"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["lang", "n"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "ok", "m"],
    "additionalProperties": False,
}
FIELDS = ["kind", "ok", "m.lang", "m.n"]
ENUM_FIELDS = ("kind", "ok", "m.lang")
N_FREE = 8


def text_of(i: int) -> str:
    return f"invoice {i} total {i * 7} EUR"


def write_jsonl(path: Path, lines: list) -> None:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")


def job(model: Path, inp: Path, out: Path, **over) -> dict:
    d = {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(inp), "id_column": "doc_id"},
        "output": {"path": str(out), "rows_per_part": 4},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 6, "ignore_eos": True},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 96},
    }
    d.update(over)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("report")
    cache: dict = {}

    def engines(spec, on_step=None):  # one engine per config; the observer's step hook is re-bound per run
        key = spec.engine_config()
        if key not in cache:
            cache[key] = make_engine(spec)
        cache[key].on_step = on_step
        return cache[key]

    docs = [{"doc_id": f"s{i}", "text": f"Invoice {i}: total {i * 11} EUR, due in {i} days."} for i in range(5)]
    lines = docs[:3] + [{"doc_id": "bad", "body": "no text column"}, "not json at all"] + docs[3:]
    write_jsonl(tmp / "s.jsonl", lines)
    (tmp / "schema.json").write_text(json.dumps(SCHEMA))
    structured = job(tiny_model, tmp / "s.jsonl", tmp / "s", structured={"json_schema": str(tmp / "schema.json")},
                     sampling={"max_tokens": 40})
    batchinfer.run(structured, engine_factory=engines, log_token_ids=True)

    write_jsonl(tmp / "a.jsonl", [{"doc_id": f"d{i:02d}", "text": text_of(i)} for i in range(N_FREE)])
    write_jsonl(tmp / "b.jsonl", [{"doc_id": f"d{i:02d}", "text": text_of(i)} for i in [*range(1, N_FREE), 99]])
    batchinfer.run(job(tiny_model, tmp / "a.jsonl", tmp / "a"), engine_factory=engines, log_token_ids=True)
    changed = job(tiny_model, tmp / "b.jsonl", tmp / "b", prompt={"template": "Doc: {{ text | replace('7', 'seven') }}"})
    batchinfer.run(changed, engine_factory=engines, log_token_ids=True)
    return {"s": tmp / "s", "a": tmp / "a", "b": tmp / "b", "tmp": tmp, "model": tiny_model}


def output(out: Path) -> pl.DataFrame:
    return pl.read_parquet(Manifest.load(out).part_paths)


def report_of(out: Path) -> dict:
    return json.loads(layout.report_json_path(out).read_text())


def chromium_dom(page: Path, tmp: Path) -> str:
    probed = tmp / f"probed-{page.stem}.html"
    probed.write_text(page.read_text().replace("</body>", PROBE))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-probed="yes"' in dom, dom[-2000:]
    return dom


def element(dom: str, ident: str) -> str:
    m = re.search(rf'<(\w+)[^>]*\bid="{re.escape(ident)}"[^>]*>(.*?)</\1>', dom, re.S)
    assert m is not None, f"no element #{ident}"
    return m.group(2)


def visible(fragment: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", fragment).replace("&amp;", "&").split())


# ------------------------------------------------------------------------------------------ report


def test_report_numbers_are_the_outputs(runs):
    out = runs["s"]
    report, table = report_of(out), output(out)
    ok = table.filter(pl.col("error").is_null())
    h = report["headline"]
    assert (h["rows"], h["rows_ok"], h["rows_error"], h["rows_rejected"]) == (6, ok.height, 6 - ok.height, 1)
    assert report["model"]["name"] == runs["model"].name and report["model"]["family"] == "qwen3"
    assert report["model"]["dtype"] == "float32" and report["model"]["quantization"] == "none"
    assert report["device"]["kind"] == "cpu" and "note" in h["roofline"]
    # (epoch seconds near 1.8e9 hold ~2e-7 s: a difference of two of them is no finer than that)
    assert report["times"]["end"] - report["times"]["start"] == pytest.approx(h["wall_s"], abs=1e-6)
    assert h["documents_per_hour"] == pytest.approx(6 * 3600 / h["wall_s"])

    # what the answers say: each field's counts are the output's, every schema value listed
    fields = {f["path"]: f for f in report["answers"]["fields"]}
    assert list(fields) == FIELDS
    flat = ok.select(pl.col("output").struct.unnest()).unnest("m")
    for path, col, values in (("kind", "kind", ["inv", "ltr", "rep"]), ("ok", "ok", [True, False]),
                              ("m.lang", "lang", ["en", "de"])):
        f = fields[path]
        want = {v: flat.get_column(col).to_list().count(v) for v in values}
        assert dict((k, n) for k, n in f["counts"]) == want and [k for k, _ in f["counts"]] == values
        assert f["nulls"] == 0 and f["n"] == ok.height
    pages = fields["m.n"]
    assert pages["kind"] == "integer" and sum(pages["hist"]["counts"]) == ok.height
    assert pages["min"] == flat.get_column("n").min() and pages["max"] == flat.get_column("n").max()
    assert all(e % 1 == 0.5 for e in pages["hist"]["edges"])  # whole-number bins

    # sample answers: the output's answers, with the input they came from; the bad row under its error kind
    s = report["samples"]
    texts = {r["doc_id"]: r["output_text"] for r in table.iter_rows(named=True)}
    assert 1 <= len(s["ok"]) <= 5
    for r in s["ok"]:
        assert r["answer"] == texts[r["id"]] and r["excerpt"].startswith(f"Invoice {r['id'][1:]}: total")
    (kind, err), = s["errors"].items()
    assert err["count"] == 1 and err["rows"][0]["id"] == "bad" and "template column 'text' is missing" in kind
    assert s["rejects"]["count"] == 1 and s["rejects"]["examples"][0]["text"] == "not json at all"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_report_page_in_chromium(runs):
    out, tmp = runs["s"], runs["tmp"]
    report = report_of(out)
    page = layout.report_html_path(out).local_path()
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    dom = chromium_dom(page, tmp)
    # the headline: the model (name, family, dtype) and the wall time, as a person writes them
    model = visible(element(dom, "fact-model"))
    assert runs["model"].name in model and "qwen3" in model and "float32" in model and "no quantization" in model
    assert labels.seconds(report["headline"]["wall_s"]) in visible(element(dom, "fact-wall"))
    assert "ok" in visible(element(dom, "fact-rows")) and "1 rejected" in visible(element(dom, "fact-rows"))
    assert dom.index('id="fact-model"') < dom.index('id="samples"') < dom.index('id="plot-throughput"')
    # sample answers: each shown row's answer and input excerpt
    ok = visible(element(dom, "samples-ok"))
    for r in report["samples"]["ok"]:
        assert r["id"] in ok and visible(r["answer"]) in ok and r["excerpt"] in ok
    assert "template column" in dom and "bad" in dom
    href = re.search(r'id="rejects-link" href="([^"]+)"', dom).group(1)
    assert (page.parent / href).resolve() == layout.rejects_path(out).local_path().resolve()
    # a decoded distribution plot per enum (and boolean) field, a histogram for the integer field
    for path in (*ENUM_FIELDS, "m.n"):
        tag = re.search(rf'<img id="plot-field-{path.replace(".", "-")}"[^>]*>', dom)
        assert tag is not None, path
        size = re.search(r'data-decoded="(\d+)x(\d+)"', tag.group(0))
        assert size is not None and int(size.group(1)) > 200 and int(size.group(2)) > 100
    # human labels: no raw fractions or record keys before the collapsed details
    shown = visible(dom[: dom.index("<h2>Details")])
    assert not re.search(r"\b0\.\d{4,}\b", shown), re.search(r"\b0\.\d{4,}\b", shown)
    for key in ("peak_used_frac", "rows_per_s", "completion_tokens", "ttft_s", "engine_s"):
        assert key not in shown


def test_plot_axes_start_at_zero_and_token_bins_are_whole(runs):
    from batchinfer.observe.report import load_records

    steps, rows, _ = load_records(runs["s"])
    fig = plots.throughput(steps, rows)
    assert len(fig.axes) == 2 and all(ax.get_ylim()[0] == 0 for ax in fig.axes)  # tokens/s and rows/s
    for ax, column in zip(plots.lengths(rows).axes, ("prompt_tokens", "completion_tokens")):
        (outline,) = ax.patches  # one filled step outline per histogram
        data = outline.get_data()
        assert all(abs(e % 1 - 0.5) < 1e-6 for e in data.edges)
        assert data.values.sum() == rows.get_column(column).drop_nulls().len() and ax.get_ylim()[0] == 0


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=200))
def test_integer_bins_cover_the_values_in_whole_tokens(values):
    edges = plots.integer_bins(values)
    width = edges[1] - edges[0]
    assert width == int(width) >= 1 and len(edges) - 1 <= 50
    assert all(b - a == width for a, b in zip(edges, edges[1:]))
    assert edges[0] < min(values) and edges[-1] > max(values) and edges[0] % 1 == 0.5


def test_labels():
    assert labels.pct(0.06055) == "6.1 %" and labels.pct(1.0) == "100.0 %" and labels.pct(0.0) == "0.0 %"
    assert labels.pct(0.0004) == "< 0.1 %" and labels.pct(0.99996) == "> 99.9 %" and labels.pct(None) == "\u2013"
    assert labels.seconds(0.85) == "850 ms" and labels.seconds(12.34) == "12.3 s"
    assert labels.seconds(245) == "4 min 05 s" and labels.seconds(7385) == "2 h 03 min"
    assert labels.num(4369.2) == "4,369" and labels.num(26.27) == "26.3" and labels.num(0.835) == "0.835"


def test_schema_fields_walk_nested_refs_and_nullables():
    schema = {
        "$defs": {"money": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}}}},
        "type": "object",
        "properties": {
            "total": {"$ref": "#/$defs/money"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "flag": {"type": ["boolean", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"},
        },
    }
    assert schema_fields(schema) == [
        FieldSpec("total.amount", "number"), FieldSpec("total.currency", "enum", ("EUR", "USD")),
        FieldSpec("note", "string"), FieldSpec("flag", "boolean", (True, False)), FieldSpec("tags", "array"),
        FieldSpec("n", "integer"),
    ]


def test_field_stats_count_values_and_nulls():
    frame = pl.DataFrame({
        "_id": [str(i) for i in range(50)],
        "currency": ["EUR"] * 49 + [None],
        "amount": [float(i) for i in range(50)],
        "name": [f"n{i % 3}" for i in range(50)],
    })
    specs = [FieldSpec("currency", "enum", ("EUR", "USD")), FieldSpec("amount", "number"), FieldSpec("name", "string")]
    cur, amount, name = field_stats(frame, specs)
    assert cur["counts"] == [["EUR", 49], ["USD", 0]] and cur["nulls"] == 1 and cur["null_share"] == pytest.approx(0.02)
    assert sum(amount["hist"]["counts"]) == 50 and amount["min"] == 0 and amount["max"] == 49
    assert name["distinct"] == 3 and name["top"][0] == ["n0", 17] and name["lengths"] == {"min": 2, "p50": 2.0, "max": 2}


def test_roofline_on_a_known_gpu():
    from batchinfer.bench.devices import datasheet_ceilings
    from batchinfer.bench.roofline import workload_floor
    from batchinfer.observe.runinfo import roofline_facts

    rows = pl.DataFrame({"finish_reason": ["stop", "length", "error"], "prompt_tokens": [100, 300, 5000],
                         "completion_tokens": [50, 64, 0]})
    model = {"dtype": "bfloat16", "num_layers": 28, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "layer_params": 440_000_000, "params": 600_000_000}
    got = roofline_facts(rows, model, {"kind": "cuda", "name": "NVIDIA H200", "count": 1}, 2.0, 1000, 16)
    ceil = datasheet_ceilings("NVIDIA H200", "bfloat16")
    want = workload_floor([100, 300], [50, 64], num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                          vocab_size=151936, layer_params=440_000_000, weight_bytes=1_200_000_000, dtype_bytes=2,
                          kv_capacity_tokens=16000, ceilings=ceil)
    assert got["fraction"] == pytest.approx(want.floor_s / 2.0) and got["bound"] == want.bound
    assert "note" in roofline_facts(rows, {**model, "dtype": "float32"}, {"kind": "cuda", "name": "NVIDIA H200"}, 2.0, 1000, 16)
    assert "note" in roofline_facts(rows, model, {"kind": "cuda", "name": "Some GPU"}, 2.0, 1000, 16)


def test_excerpts_are_kept_for_a_few_rows_of_each_outcome(tmp_path):
    out = tmp_path / "out"
    with Observer(ObserveOptions(out_dir=out, report=False)) as obs:
        for kind, ev in simulate(60, start=obs.t0, error_every=4).events:
            if kind == "step":
                obs.on_step(ev)
            else:
                obs.on_result(*ev, excerpt=f"text of {ev[0]}")
    rec = read_parts(layout.rows_dir(out), ROW_SCHEMA)
    kept = rec.filter(pl.col("excerpt").is_not_null())
    assert kept.filter(~pl.col("failed")).height == observer_mod.EXCERPT_OK_ROWS
    assert kept.filter(pl.col("failed")).height == observer_mod.EXCERPT_ROWS_PER_ERROR_KIND  # one error kind
    assert all(e == f"text of {i}" for i, e in kept.select("id", "excerpt").iter_rows())


def test_records_follow_the_layout(tmp_path, monkeypatch):
    """Every record path comes from io/layout.py: moving them is a change there alone."""
    from batchinfer.io.store import location

    out, hidden = tmp_path / "out", tmp_path / ".out.records"
    monkeypatch.setattr(layout, "records_dir", lambda o: location(Path(str(o)).parent / f".{Path(str(o)).name}.records"))
    with Observer(ObserveOptions(out_dir=out, log_token_ids=True, report=False)) as obs:
        sim = simulate(12, start=obs.t0)
        manifest = Manifest(out, fingerprint="fp", id_column="id")
        manifest.save()
        feed(obs, sim.events)
        commit_part(out, manifest, list(sim.results.values()))
    assert "rows 12 " in report_command(out)
    assert sorted(p.name for p in out.iterdir()) == ["part-000000.parquet"]
    assert {p.name for p in hidden.iterdir()} >= {"manifest.json", "rows", "steps", "token_ids", "report.json", "report.html"}
    assert not (tmp_path / "_out.batchinfer").exists()
    assert read_token_ids(out).height == 12


# ----------------------------------------------------------------------------------------- compare


def test_compare_a_run_with_itself_is_identical(runs):
    c = compare_runs(runs["s"], runs["s"])
    n = output(runs["s"]).height
    assert (c.matched, c.identical, c.differing, c.only_a, c.only_b) == (n, n, 0, 0, 0)
    assert c.identical_share == 1.0 and c.changed == ()
    assert [f.path for f in c.fields] == FIELDS
    assert all(f.share == 1.0 and f.compared == c.a.ok for f in c.fields)
    r = CliRunner().invoke(app, ["compare", str(runs["s"]), str(runs["s"])])
    assert r.exit_code == 0, r.output
    assert f"identical answers: {n} of {n} (100.0 %)" in r.output


def test_compare_finds_the_rows_a_changed_prompt_changed(runs):
    a, b = runs["a"], runs["b"]
    c = compare_runs(a, b)
    prompt_changed = {f"d{i:02d}" for i in range(1, N_FREE) if "7" in text_of(i)}
    assert (c.matched, c.only_a_ids, c.only_b_ids) == (N_FREE - 1, ("d00",), ("d99",))
    changed = {ch.id for ch in c.changed}
    assert changed and changed <= prompt_changed  # rows with the same prompt answer the same
    assert c.identical == c.matched - len(changed) and c.token_level and c.same_prompt_differing == 0
    ids_a = {r["id"]: r["output_token_ids"] for r in read_token_ids(a).iter_rows(named=True)}
    ids_b = {r["id"]: r["output_token_ids"] for r in read_token_ids(b).iter_rows(named=True)}
    texts_a = dict(output(a).select("doc_id", "output_text").iter_rows())
    texts_b = dict(output(b).select("doc_id", "output_text").iter_rows())
    from batchinfer.models.loader import load_tokenizer

    tok = load_tokenizer(runs["model"])
    for ch in c.changed:
        ta, tb, k = ids_a[ch.id], ids_b[ch.id], ch.first_token
        assert ta[:k] == tb[:k] and (k == min(len(ta), len(tb)) or ta[k] != tb[k])
        assert ch.token_a == ta[k] and ch.token_b == tb[k]
        assert ch.token_text_a == tok.decode([ta[k]], skip_special_tokens=False)
        sa, sb, j = texts_a[ch.id], texts_b[ch.id], ch.first_char
        assert sa[:j] == sb[:j] and sa[j:j + 1] != sb[j:j + 1]
        assert 0 < ch.changed_share <= 1
        assert ch.same_prompt is False  # these rows' prompts were changed
    shares = [ch.changed_share for ch in c.changed]
    assert shares == sorted(shares, reverse=True)  # the rows that changed most first

    page = runs["tmp"] / "compare.html"
    r = CliRunner().invoke(app, ["compare", str(a), str(b), "--html", str(page)])
    assert r.exit_code == 0, r.output
    assert f"differing: {len(changed)}" in r.output and "only in A: d00" in r.output and "only in B: d99" in r.output
    html = page.read_text()
    assert "http" not in html and all(f">{i}<" in html for i in changed)
    as_json = json.loads(CliRunner().invoke(app, ["compare", str(a), str(b), "--json"]).output)
    assert as_json["identical"] == c.identical and as_json["identical_share"] == c.identical_share
    if CHROMIUM is not None:
        dom = chromium_dom(page, runs["tmp"])
        assert "Identical answers" in dom and all(i in visible(element(dom, "changed-rows")) for i in changed)
        assert re.search(r'id="plot-first-token"[^>]*data-decoded="\d{3,}x\d{3,}"', dom)


def test_compare_errors_are_one_line(tmp_path, runs):
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "missing"), str(runs["a"])])
    assert r.exit_code == 2 and "no such output folder" in r.output and "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["compare", str(runs["a"]), str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no committed output" in r.output


def test_several_answers_per_row_compare_and_count_as_answers(tmp_path):
    """sampling.n > 1 output (a list column `answers`): compared as all answers in order, fields over every answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchinfer.io.manifest import PartInfo
    from batchinfer.observe.answers import answer_columns, output_frame

    answer = pa.struct([("output_text", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
                        ("output", pa.struct([("kind", pa.string())]))])

    def write(out: Path, kinds: dict[str, list[str]]) -> None:
        out.mkdir()
        rows = [{"id": i, "finish_reason": "stop", "error": None,
                 "answers": [{"output_text": json.dumps({"kind": k}), "finish_reason": "stop", "error": None,
                              "output": {"kind": k}} for k in ks]} for i, ks in kinds.items()]
        table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("finish_reason", pa.string()),
                                                             ("error", pa.string()), ("answers", pa.list_(answer))]))
        pq.write_table(table, out / "part-000000.parquet")
        manifest = Manifest(out, fingerprint="fp", id_column="id")
        manifest.add_part(PartInfo("part-000000.parquet", table.num_rows, 0))

    write(tmp_path / "a", {"r1": ["inv", "ltr"], "r2": ["rep", "rep"], "r3": ["inv", "inv"]})
    write(tmp_path / "b", {"r1": ["inv", "ltr"], "r2": ["rep", "inv"], "r3": ["inv", "inv"]})
    c = compare_runs(tmp_path / "a", tmp_path / "b")
    assert (c.matched, c.identical) == (3, 2) and [ch.id for ch in c.changed] == ["r2"]
    ch = c.changed[0]
    assert ch.first_token is None and ch.answer_a.startswith('{"kind": "rep"}') and "inv" in ch.answer_b
    cols = answer_columns(output_frame(Manifest.load(tmp_path / "a")), {"json_schema": SCHEMA}, None)
    assert sorted(cols.get_column("kind").to_list()) == ["inv", "inv", "inv", "ltr", "rep", "rep"]


@given(st.dictionaries(st.sampled_from(["text", "title", "body"]), st.text(" \n\tabc\u00e9", max_size=700) | st.integers()),
       st.integers(20, 300))
@example(values={"text": "a" * 20 + " a"}, limit=20)  # a head exactly `limit` long with more after it
def test_input_excerpt_is_one_short_line(values, limit):
    from batchinfer.job.requests import input_excerpt

    got = input_excerpt(values, ["body", "text"], limit)
    present = [c for c in ("body", "text") if values.get(c) is not None]
    if not present:
        assert got is None
        return
    one_line = [" ".join(str(values[c]).split()) for c in present]
    full = " | ".join(one_line if len(present) == 1 else [f"{c}: {v}" for c, v in zip(present, one_line)])
    if len(full) <= limit:
        assert got == full
    else:
        assert len(got) <= limit and got.endswith("\u2026") and full.startswith(got[:-1])


def test_input_excerpt_of_chat_messages_is_the_user_message():
    from batchinfer.job.requests import input_excerpt

    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort\n this  doc"}]}
    assert input_excerpt({"body": body}, ["body"]) == "Sort this doc"
    assert input_excerpt({"chat": body["messages"]}, ["chat"]) == "Sort this doc"
