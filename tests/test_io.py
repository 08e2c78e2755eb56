"""Readers, id checks, part writer and manifest (commit protocol and recovery)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset  # noqa: F401
import pyarrow.parquet as pq
import pytest

from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.io.ids import check_ids
from batchinfer.io.readers import InputError, Reject, Row, iter_rows, list_input_files
from batchinfer.io.writer import PartWriter, output_schema
from batchinfer.job.spec import JobError
from batchinfer.job.results import result_columns


def write_jsonl(path: Path, lines: list) -> Path:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_list_files_file_folder_glob(tmp_path):
    pq.write_table(pa.table({"id": [1]}), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"id": 2}])
    write_jsonl(tmp_path / "c.jsonl.gz", [{"id": 3}])
    (tmp_path / "_skip.parquet").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    assert [f.format for f in list_input_files(str(tmp_path))] == ["parquet", "jsonl", "jsonl"]
    assert len(list_input_files(str(tmp_path / "*.jsonl*"))) == 2
    assert list_input_files(str(tmp_path / "a.parquet"))[0].format == "parquet"
    with pytest.raises(InputError, match="no files match"):
        list_input_files(str(tmp_path / "*.csv"))
    with pytest.raises(InputError, match="not found"):
        list_input_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(InputError, match="unknown format"):
        list_input_files(str(tmp_path / "notes.txt"))
    assert list_input_files(str(tmp_path / "notes.txt"), "jsonl")[0].format == "jsonl"


def test_jsonl_rejects_lines_without_an_id(tmp_path):
    f = write_jsonl(
        tmp_path / "x.jsonl.gz",
        [{"id": "a", "t": 1}, "not json", "[1, 2]", {"t": 2}, {"id": None}, "", {"id": "b"}],
    )
    items = [i for b in iter_rows(list_input_files(str(f)), "id", 2) for i in b]
    rows = [i for i in items if isinstance(i, Row)]
    rejects = [i for i in items if isinstance(i, Reject)]
    assert [r.values["id"] for r in rows] == ["a", "b"]
    assert [r.line for r in rows] == [1, 7]
    assert [(r.line, r.reason.split(":")[0]) for r in rejects] == [
        (2, "not valid JSON"),
        (3, "not a JSON object (a list)"),
        (4, "id column 'id' is missing"),
        (5, "id column 'id' is null"),
    ]
    assert rejects[0].text == "not json"


def test_parquet_reader_streams_batches_and_selects_columns(tmp_path):
    pq.write_table(pa.table({"id": list(range(10)), "text": [f"t{i}" for i in range(10)], "big": ["x"] * 10}), tmp_path / "a.parquet")
    batches = list(iter_rows(list_input_files(str(tmp_path / "a.parquet")), "id", 4, ["id", "text"]))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert batches[0][0].values == {"id": 0, "text": "t0"}
    assert batches[2][1].line == 10


def test_check_ids_names_a_duplicate_and_where(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b"]}), tmp_path / "1.parquet")
    write_jsonl(tmp_path / "2.jsonl", [{"id": "c"}, "bad", {"id": "b"}])
    with pytest.raises(InputError) as e:
        check_ids(list_input_files(str(tmp_path)), "id")
    msg = str(e.value)
    assert "duplicate id 'b'" in msg and "1.parquet line 2" in msg and "2.jsonl line 3" in msg


def test_check_ids_missing_column(tmp_path):
    pq.write_table(pa.table({"key": ["a"]}), tmp_path / "1.parquet")
    with pytest.raises(InputError, match="no id column 'id'.*columns: key"):
        check_ids(list_input_files(str(tmp_path / "1.parquet")), "id")
    write_jsonl(tmp_path / "2.jsonl", [{"key": "a"}])
    with pytest.raises(InputError, match="no row has the id column 'id'"):
        check_ids(list_input_files(str(tmp_path / "2.jsonl")), "id")


def test_check_ids_counts_rows(tmp_path):
    pq.write_table(pa.table({"id": [1, 2, None]}), tmp_path / "1.parquet")
    write_jsonl(tmp_path / "2.jsonl", [{"id": 3}, {"id": 4}])
    assert check_ids(list_input_files(str(tmp_path)), "id").num_rows == 4


def _row(i, err=None):
    return {"id": i, "title": f"t{i}", "output_text": "x", "finish_reason": "error" if err else "stop",
            "prompt_tokens": 3, "completion_tokens": 1, "error": err}


def _writer(folder: Path, rows_per_part=3, fp="fp1"):
    folder.mkdir(exist_ok=True)
    m = mf.Manifest(folder, fp, {}, "id")
    m.save()
    return m, PartWriter(m, output_schema({"id": None, "title": None}, result_columns(None, 1, False)), rows_per_part, 3600)


def test_writer_commits_parts_with_temp_names_and_manifest(tmp_path):
    out = tmp_path / "out"
    m, w = _writer(out)
    for i in range(7):
        w.add(_row(i, "bad" if i == 5 else None))
    assert mf.part_files(m.folder) == ["part-000000.parquet", "part-000001.parquet"]
    w.close()
    assert [p.rows for p in m.parts] == [3, 3, 1] and sum(p.errors for p in m.parts) == 1
    # the output folder holds the parts and nothing else; no temp file is left anywhere
    assert sorted(p.name for p in out.iterdir()) == [f"part-00000{i}.parquet" for i in range(3)]
    assert not layout.tmp_dir(out).files()
    assert (tmp_path / "_out.batchinfer" / "manifest.json").is_file()
    loaded = mf.Manifest.load(m.folder)
    assert loaded.parts == m.parts and loaded.fingerprint == "fp1"
    assert set(loaded.finished_ids().to_list()) == {str(i) for i in range(7)}
    df = pl.read_parquet(out)
    assert pa.dataset.dataset(out).to_table().num_rows == 7
    assert sorted(df["id"].to_list()) == list(range(7))
    assert df.schema["prompt_tokens"] == pl.Int64 and df.schema["title"] == pl.Utf8


def test_writer_rolls_over_by_time(tmp_path):
    m, w = _writer(tmp_path / "out", rows_per_part=100)
    w.seconds_per_part = 0.0
    w.add(_row(1))
    assert len(m.parts) == 1


def test_writer_nulls_a_kept_value_that_does_not_fit(tmp_path):
    m, w = _writer(tmp_path / "out", rows_per_part=1)
    w.add(_row(1))
    w.add({**_row(2), "title": {"nested": 1}})
    df = pl.read_parquet(tmp_path / "out").sort("id")
    assert df["title"].to_list() == ["t1", None]
    assert "column 'title'" in df["error"][1] and df["finish_reason"][1] == "error"


def test_recover_adds_unrecorded_part_of_this_job_and_deletes_torn_ones(tmp_path):
    out = tmp_path / "out"
    m, w = _writer(out, rows_per_part=2)
    for i in range(4):
        w.add(_row(i))
    # simulate a kill between rename and manifest write: drop the last part from the manifest
    m.parts = m.parts[:1]
    m.save()
    # an unreadable part, a stray temp part (a kill during a write), a stray manifest temp, an older
    # version's temp file inside the output folder
    (out / "part-000007.parquet").write_bytes(b"PAR1 torn")
    tmp = tmp_path / "_out.batchinfer" / "tmp"
    tmp.mkdir(exist_ok=True)
    (tmp / ".part-000008.parquet.x1.tmp").write_bytes(b"partial")
    (tmp / ".manifest.json.x2.tmp").write_text("{")
    (out / "_tmp.part-000009.parquet.tmp").write_bytes(b"partial")
    assert mf.remove_temp_files(m.folder) == 3
    fresh = mf.Manifest.load(m.folder)
    assert mf.recover(fresh) == (1, 1)
    assert [p.name for p in fresh.parts] == ["part-000000.parquet", "part-000001.parquet"]
    assert set(fresh.finished_ids().to_list()) == {"0", "1", "2", "3"}
    assert not (out / "part-000007.parquet").exists()


def test_recover_refuses_a_part_of_another_job(tmp_path):
    out = tmp_path / "out"
    m, w = _writer(out, rows_per_part=1)
    w.add(_row(1))
    pq.write_table(pa.table({"id": [99]}), out / "part-000007.parquet")
    with pytest.raises(JobError, match="part-000007.parquet is not output of this job"):
        mf.recover(mf.Manifest.load(m.folder))
    assert (out / "part-000007.parquet").exists()


def test_recover_forgets_parts_missing_on_disk(tmp_path):
    m, w = _writer(tmp_path / "out", rows_per_part=1)
    w.add(_row(1))
    w.add(_row(2))
    (tmp_path / "out" / "part-000000.parquet").unlink()
    fresh = mf.Manifest.load(m.folder)
    mf.recover(fresh)
    assert fresh.finished_ids().to_list() == ["2"]


def test_clear_output_keeps_foreign_files(tmp_path):
    m, w = _writer(tmp_path / "out", rows_per_part=1)
    w.add(_row(1))
    (tmp_path / "out" / "README.txt").write_text("mine")
    mf.clear_output(m.folder)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["README.txt"]
    assert not layout.manifest_path(tmp_path / "out").exists()


def test_unreadable_manifest_is_a_clear_error(tmp_path):
    (tmp_path / "_out.batchinfer").mkdir()
    (tmp_path / "_out.batchinfer" / "manifest.json").write_text("{not json")
    with pytest.raises(JobError, match="manifest is unreadable"):
        mf.Manifest.load(tmp_path / "out")


def test_check_ids_mixed_id_types_share_one_text_type(tmp_path):
    """Ints in one file and strings in another: one common output type (string, the canonical key);
    an int and its text are one id, so they are duplicates."""
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "1.parquet")
    write_jsonl(tmp_path / "2.jsonl", [{"id": 3}, {"id": "x4"}])
    ids = check_ids(list_input_files(str(tmp_path)), "id")
    assert sorted(ids.ids["id"].to_list()) == ["1", "2", "3", "x4"] and ids.id_type.type == pa.string()
    write_jsonl(tmp_path / "3.jsonl", [{"id": "2"}])
    with pytest.raises(InputError, match=r"duplicate id '2'.*1.parquet line 2; .*3.jsonl line 1"):
        check_ids(list_input_files(str(tmp_path)), "id")
