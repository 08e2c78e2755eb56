"""Exactly once for every id type: one canonical key on both sides of resume, an output id column
that holds every input id (widened across files and runs), byte-exact JSONL ids, counts against the
current inputs, and the opt-in content check. In-process runs on the tiny random model."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import tempfile
from decimal import Decimal
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.job import run_job as run

TEXT = "invoice total date customer"



def job(model: Path, out: Path, inp: str, **over) -> dict:
    d = {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": inp, "id_column": "id"},
        "output": {"path": str(out), "rows_per_part": 2},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 1},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 32},
    }
    for k, v in over.items():
        d[k] = {**d[k], **v}
    return d


def output_ids(out: Path) -> list:
    """Every committed output row's id as Python values, part by part (parts may differ in id type)."""
    ids: list = []
    for p in sorted(out.glob("part-*.parquet")):
        col = pq.read_table(p, columns=["id"]).column("id")
        assert col.null_count == 0, f"{p.name} has a null id"
        ids += col.to_pylist()
    return ids


def same(a: list, b: list) -> bool:
    """Equal as multisets of ids (numbers by value: 3 == 3.0, -0.0 == 0.0)."""
    norm = lambda v: (0, v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, repr(v))  # noqa: E731
    return sorted(map(norm, a)) == sorted(map(norm, b))


def write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)


# ---- D1: rows redone on every resume -----------------------------------------------------------------


def test_float_bool_timestamp_ids_are_never_redone(tiny_model, tmp_path, engines):
    """Ids whose text Python and polars print differently (1e-07, True, timestamps) resume as done."""
    cases = {"floats": [1e-07, 2.5e-300, 1e300, -0.5, 3.0], "bools": [True, False], "mixed": [1e-07, True, "x", 12]}
    for name, values in cases.items():
        write_jsonl(tmp_path / f"{name}.jsonl", [{"id": v, "text": TEXT} for v in values])
        j = job(tiny_model, tmp_path / f"out_{name}", str(tmp_path / f"{name}.jsonl"))
        assert run(j, engine_factory=engines, report=False).this_run_rows == len(values)
        again = run(j, engine_factory=engines, report=False)
        assert again.nothing_to_do and again.rows_done == len(values), name
        if name != "mixed":
            assert same(output_ids(tmp_path / f"out_{name}"), values)
    df = pl.read_parquet(tmp_path / "out_floats" / "*.parquet")
    assert df.schema["id"] == pl.Float64 and sorted(df["id"].to_list()) == sorted(cases["floats"])
    assert pl.read_parquet(tmp_path / "out_bools" / "*.parquet").schema["id"] == pl.Boolean
    mixed = pl.read_parquet(tmp_path / "out_mixed" / "*.parquet")
    assert mixed.schema["id"] == pl.Utf8 and sorted(mixed["id"].to_list()) == ["0.0000001", "12", "true", "x"]

    ts = [dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 1, 0, 0, 1)]
    pq.write_table(pa.table({"id": pa.array(ts, pa.timestamp("us")), "text": [TEXT] * 2}), tmp_path / "t.parquet")
    jt = job(tiny_model, tmp_path / "out_t", str(tmp_path / "t.parquet"))
    assert run(jt, engine_factory=engines, report=False).this_run_rows == 2
    pq.write_table(pa.table({"id": pa.array([dt.datetime(2025, 5, 5)], pa.timestamp("us")), "text": [TEXT]}), tmp_path / "t2.parquet")
    more = run(job(tiny_model, tmp_path / "out_t", str(tmp_path / "t*.parquet")), engine_factory=engines, report=False)
    assert more.this_run_rows == 1  # a pending row does not make the finished ones run again
    assert sorted(output_ids(tmp_path / "out_t")) == ts + [dt.datetime(2025, 5, 5)]


# ---- D2: ids lost as nulls ----------------------------------------------------------------------------


def test_id_type_widens_across_files_and_runs_never_null(tiny_model, tmp_path, engines):
    """int32 file, then an int64 file, then string ids in a JSONL file: every id once, none null, old
    parts rewritten in the wider type; the report reads the output."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int32()), "text": [TEXT] * 3}), tmp_path / "in" / "a.parquet")
    j = job(tiny_model, tmp_path / "out", str(tmp_path / "in"))
    assert run(j, engine_factory=engines, report=False).this_run_rows == 3
    big = 1_099_511_627_776
    pq.write_table(pa.table({"id": pa.array([big, 5], pa.int64()), "text": [TEXT] * 2}), tmp_path / "in" / "b.parquet")
    s = run(j, engine_factory=engines, report=False)
    assert s.this_run_rows == 2 and s.error_rows == 0 and "5 of 5" in s.describe()
    assert sorted(output_ids(tmp_path / "out")) == [1, 2, 3, 5, big]
    assert {str(pq.read_schema(p).field("id").type) for p in (tmp_path / "out").glob("part-*.parquet")} == {"int64"}
    assert run(j, engine_factory=engines, report=False).nothing_to_do
    write_jsonl(tmp_path / "in" / "c.jsonl", [{"id": "x1", "text": TEXT}, {"id": "x2", "text": TEXT}])
    s = run(j, engine_factory=engines)
    assert s.this_run_rows == 2 and s.error_rows == 0 and "7 of 7" in s.describe()
    df = pl.read_parquet(tmp_path / "out" / "*.parquet")
    assert df.schema["id"] == pl.Utf8 and sorted(df["id"].to_list()) == sorted(["1", "2", "3", "5", str(big), "x1", "x2"])
    assert df["error"].null_count() == 7
    assert run(j, engine_factory=engines, report=False).nothing_to_do
    from batchinfer.observe import report_command

    assert "rows" in report_command(tmp_path / "out")


# ---- ids byte-exact -------------------------------------------------------------------------------


def test_invalid_utf8_is_rejected_and_a_bom_is_skipped(tiny_model, tmp_path, engines):
    bom = b"\xef\xbb\xbf"
    good = [json.dumps({"id": f"g{i}", "text": TEXT}).encode() for i in range(3)]
    bad = b'{"id": "utf2\xff", "text": "t"}'
    (tmp_path / "a.jsonl").write_bytes(bom + good[0] + b"\n" + bad + b"\n" + good[1] + b"\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as fh:
        fh.write(bom + good[2] + b"\n")
    s = run(job(tiny_model, tmp_path / "out", str(tmp_path / "*.jsonl*")), engine_factory=engines, report=False)
    ids = output_ids(tmp_path / "out")
    assert sorted(ids) == ["g0", "g1", "g2"] and not any("\ufffd" in i for i in ids)
    rejects = [json.loads(x) for x in layout.rejects_path(tmp_path / "out").read_text().splitlines()]
    assert len(rejects) == 1 and s.rejects == 1
    r = rejects[0]
    assert r["file"].endswith("a.jsonl") and r["line"] == 2 and "not valid UTF-8" in r["reason"] and "\\xff" in r["text"]


# ---- counts against the current inputs; edited rows -----------------------------------------------------


def test_deleted_input_file_is_not_counted_as_this_jobs_rows(tiny_model, tmp_path, engines):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": TEXT} for i in range(3)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": i, "text": TEXT} for i in range(3, 5)])
    j = job(tiny_model, tmp_path / "out", str(tmp_path / "in"))
    run(j, engine_factory=engines, report=False)
    (tmp_path / "in" / "b.jsonl").unlink()
    s = run(j, engine_factory=engines, report=False)
    assert s.nothing_to_do and s.rows_done == 3 and s.input_rows == 3 and s.outside_rows == 2
    text = s.describe()
    assert "output holds 3 of 3 rows" in text and "2 more committed rows belong to inputs that are gone" in text


def test_edited_row_keeps_its_answer_unless_check_content(tiny_model, tmp_path, engines):
    rows = [{"id": i, "text": f"{TEXT} {i}"} for i in range(4)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    plain = job(tiny_model, tmp_path / "plain", str(tmp_path / "a.jsonl"))
    checked = job(tiny_model, tmp_path / "checked", str(tmp_path / "a.jsonl"), input={"check_content": True})
    run(plain, engine_factory=engines, report=False)
    run(checked, engine_factory=engines, report=False)
    before = pl.read_parquet(tmp_path / "checked" / "*.parquet").sort("id")
    assert before["input_hash"].null_count() == 0 and before["input_hash"].n_unique() == 4
    rows[2]["text"] = "a different document"
    write_jsonl(tmp_path / "a.jsonl", rows)
    assert run(plain, engine_factory=engines, report=False).nothing_to_do  # documented: the old answer stays
    s = run(checked, engine_factory=engines, report=False)
    assert s.this_run_rows == 1 and s.redone_rows == 1 and "4 of 4" in s.describe()
    after = pl.read_parquet(tmp_path / "checked" / "*.parquet").sort("id")
    assert after["id"].to_list() == [0, 1, 2, 3]
    changed = after.join(before, on="id", suffix="_old").filter(pl.col("input_hash") != pl.col("input_hash_old"))
    assert changed["id"].to_list() == [2]
    assert run(checked, engine_factory=engines, report=False).nothing_to_do


# ---- every id exactly once: id types x formats x kill points ------------------------------------------------


class Killed(BaseException):
    """The fault hook's kill: raised from inside the run once the manifest holds N parts."""


def committed(out: Path) -> int:
    try:
        return len(json.loads(layout.manifest_path(out).read_text())["parts"])
    except (OSError, ValueError, KeyError):
        return 0


def kill_after(out: Path, parts: int):
    def hook(progress) -> None:
        if committed(out) >= parts:
            raise Killed()

    return hook


JSON_KINDS = {
    "str": st.text(min_size=1, max_size=6),
    "int": st.integers(-(2**63), 2**63 - 1),
    "bigint": st.integers(2**63, 2**70),
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "bool": st.booleans(),
}
PARQUET_KINDS = {
    "str": (st.text(min_size=1, max_size=6), pa.string()),
    "int64": (st.integers(-(2**63), 2**63 - 1), pa.int64()),
    "int32": (st.integers(-(2**31), 2**31 - 1), pa.int32()),
    "float": (st.floats(allow_nan=False, allow_infinity=False), pa.float64()),
    "bool": (st.booleans(), pa.bool_()),
    "date": (st.dates(), pa.date32()),
    "ts": (st.datetimes(), pa.timestamp("us")),
    "ts_tz": (st.datetimes(timezones=st.just(dt.timezone.utc)), pa.timestamp("us", tz="UTC")),
    "decimal": (st.decimals(min_value=-(10**6), max_value=10**6, places=2), pa.decimal128(10, 2)),
}


def ref_key(v) -> str:
    """The README's canonical id text, written independently of io/id_key.py (the test's oracle)."""
    import numpy as np

    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "0" if v == 0 else np.format_float_positional(v, unique=True, trim="-")
    if isinstance(v, Decimal):
        text = format(v, "f")
        text = text.rstrip("0").rstrip(".") if "." in text else text
        return "0" if text in ("-0", "") else text
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(dt.timezone.utc).isoformat()
    return v.isoformat()


@st.composite
def inputs(draw):
    """1-2 files, each a format and an id kind; ids unique across files by their canonical key."""
    id_key = ref_key
    files = []
    seen: set[str] = set()
    for i in range(draw(st.integers(1, 2))):
        fmt = draw(st.sampled_from(["parquet", "jsonl", "jsonl.gz"]))
        if fmt == "parquet":
            kind = draw(st.sampled_from(sorted(PARQUET_KINDS)))
            strategy, typ = PARQUET_KINDS[kind]
        else:
            kind = draw(st.sampled_from(sorted(JSON_KINDS)))
            strategy, typ = JSON_KINDS[kind], None
        values = draw(st.lists(strategy, min_size=1, max_size=5, unique_by=id_key))
        values = [v for v in values if id_key(v) not in seen]
        seen.update(id_key(v) for v in values)
        if values:
            files.append((f"f{i}.{fmt}", typ, values))
    return files


def write_inputs(folder: Path, files) -> list:
    for name, typ, values in files:
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"id": pa.array(values, typ), "text": [TEXT] * len(values)}), folder / name)
        else:
            write_jsonl(folder / name, [{"id": v, "text": TEXT} for v in values], gz=name.endswith(".gz"))
    return [v for _, _, values in files for v in values]


def output_keys(out: Path) -> list[str]:
    keys = []
    for p in sorted(out.glob("part-*.parquet")):
        col = pq.read_table(p, columns=["id"]).column("id")
        assert col.null_count == 0, f"{p.name} holds a null id"
        keys += [ref_key(v) for v in col.to_pylist()]
    return keys


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=inputs(), kills=st.lists(st.integers(1, 2), min_size=1, max_size=2))
def test_every_id_exactly_once_across_kills(tiny_model, engines, files, kills):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "in").mkdir()
        values = write_inputs(tmp / "in", files)
        out = tmp / "out"
        j = job(tiny_model, out, str(tmp / "in"), output={"rows_per_part": 1})
        for k in kills:  # each kill lands after k more committed parts
            target = committed(out) + k
            try:
                run(j, engine_factory=engines, on_progress=kill_after(out, target), report=False)
            except Killed:
                assert committed(out) >= target
        s = run(j, engine_factory=engines, report=False)
        assert sorted(output_keys(out)) == sorted(ref_key(v) for v in values)  # every id exactly once
        assert s.rows_done == len(values) and s.error_rows == 0
        assert run(j, engine_factory=engines, report=False).nothing_to_do  # a finished job runs nothing


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=inputs())
def test_every_id_exactly_once_after_sigkill_of_a_cli_run(tiny_model, engines, files):
    """The same, with `kill -9` of a real CLI run once its manifest shows a committed part."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "in").mkdir()
        values = write_inputs(tmp / "in", files)
        out = tmp / "out"
        j = job(tiny_model, out, str(tmp / "in"), output={"rows_per_part": 1}, sampling={"max_tokens": 4})
        (tmp / "job.yaml").write_text(yaml.safe_dump(j))
        p = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "run", str(tmp / "job.yaml"), "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while committed(out) < 1 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        run(j, engine_factory=engines, report=False)
        assert sorted(output_keys(out)) == sorted(ref_key(v) for v in values)
        assert run(j, engine_factory=engines, report=False).nothing_to_do
