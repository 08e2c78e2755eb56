"""Hive partitions: `key=value` folders become typed columns of every row, as pyarrow infers them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchinfer
from batchinfer.io.readers import iter_rows, list_input_files
from batchinfer.observe import read_token_ids

# partition values that exercise pyarrow's inference: ints (leading zeros, signs, out of int32), text, null
VALUES = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(str),
    st.integers(0, 99).map(lambda i: f"{i:03d}"),
    st.sampled_from(["2147483648", "-2147483649", "+1", " 1", "1.5", "", "x", "eu-west", "a b", "__HIVE_DEFAULT_PARTITION__"]),
)


def _segment(key: str, value: str) -> str:
    from urllib.parse import quote

    return f"{key}={quote(value, safe='_-+.')}" if value != "__HIVE_DEFAULT_PARTITION__" else f"{key}={value}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(VALUES, VALUES), min_size=1, max_size=4, unique=True))
def test_partition_columns_are_typed_and_valued_like_pyarrow(tmp_path_factory, paths):
    root = tmp_path_factory.mktemp("hive")
    for i, (a, b) in enumerate(paths):
        folder = root / _segment("a", a) / _segment("b", b)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [i]}), folder / f"f{i}.parquet")
    files = list_input_files(str(root))
    if any(all(v == "__HIVE_DEFAULT_PARTITION__" for v in col) for col in zip(*paths)):
        # pyarrow cannot infer a type from nulls only (it refuses the dataset); ours is a string of nulls
        assert all(dict(f.partitions)[k] is None for f in files for k, col in zip("ab", zip(*paths))
                   if all(v == "__HIVE_DEFAULT_PARTITION__" for v in col))
        return
    theirs = ds.dataset(str(root), format="parquet", partitioning="hive")
    table = theirs.to_table()
    want = {r["id"]: (r["a"], r["b"]) for r in table.to_pylist()}
    ours = {}
    for batch in iter_rows(files, "id", 10):
        for row in batch:
            ours[row.values["id"]] = (row.values["a"], row.values["b"])
    assert ours == want
    from batchinfer.io.readers import partition_types

    types = partition_types(files)
    assert (types["a"], types["b"]) == (theirs.schema.field("a").type, theirs.schema.field("b").type)


def write_hive_jsonl(root: Path) -> list[dict]:
    rows = []
    for y, m, n in ((2024, "01", 3), (2024, "12", 2), (2025, "03", 4)):
        folder = root / f"year={y}" / f"month={m}"
        folder.mkdir(parents=True)
        part = [{"doc_id": f"{y}-{m}-{i}", "text": f"doc {i}"} for i in range(n)]
        if y == 2025:
            part[0]["month"] = 7  # a column of the file itself wins over the folder's value
        (folder / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        rows += [{**r, "year": y, "month": r.get("month", int(m))} for r in part]
    return rows


def test_jsonl_partitions_are_columns_of_the_row(tmp_path):
    want = write_hive_jsonl(tmp_path / "in")
    got = [r.values for b in iter_rows(list_input_files(str(tmp_path / "in" / "**" / "*.jsonl")), "doc_id", 4) for r in b]
    assert sorted(got, key=lambda r: r["doc_id"]) == sorted(want, key=lambda r: r["doc_id"])
    # a single file has no partition root: its path's folders are not columns
    (one,) = list_input_files(str(tmp_path / "in" / "year=2024" / "month=01" / "part.jsonl"))
    assert one.partitions == ()


def test_a_job_reads_partition_columns_in_templates_and_keep_columns(tiny_model, tmp_path):
    from batchinfer.models.loader import load_tokenizer

    want = write_hive_jsonl(tmp_path / "in")
    job = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": str(tmp_path / "in"), "id_column": "doc_id"},
        "output": {"path": str(tmp_path / "out"), "keep_columns": ["year", "month"]},
        "prompt": {"template": "year {{ year }} month {{ month }}: {{ text }}", "chat": False},
        "sampling": {"max_tokens": 2},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 32},
    }
    s = batchinfer.run(job, log_token_ids=True)
    assert s.rows_done == len(want) and s.error_rows == 0
    out = pq.read_table(str(tmp_path / "out"))
    assert out.schema.field("year").type == pa.int32() and out.schema.field("month").type == pa.int32()
    assert sorted(zip(*(out.column(c).to_pylist() for c in ("doc_id", "year", "month")))) == sorted(
        (r["doc_id"], r["year"], r["month"]) for r in want)
    tok = load_tokenizer(tiny_model)
    prompts = {r["id"]: tok.decode(r["prompt_token_ids"]) for r in read_token_ids(tmp_path / "out").iter_rows(named=True)}
    assert prompts["2025-03-0"] == "year 2025 month 7: doc 0" and prompts["2024-12-1"] == "year 2024 month 12: doc 1"
