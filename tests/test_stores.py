"""Inputs and outputs on stores other than the local disk (io/store.py): a real S3-compatible server
on 127.0.0.1 (moto's server mode, tests/s3_server.py) reached over HTTP by pyarrow's S3 client, and
an fsspec store (memory://). Runs killed or failed mid-way and resumed give every id exactly once;
the commit protocol on S3 never shows a half part; glob and path rules match the local ones."""

from __future__ import annotations

import glob as globlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml

import batchinfer
from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.io.readers import iter_rows, list_input_files
from batchinfer.io.store import LockedError, expand_glob, location
from batchinfer.job import JobError, load_job

pytest.importorskip("moto")
pytest.importorskip("werkzeug")

N = 20


@pytest.fixture(scope="module")
def s3():
    import logging

    import s3_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server, env = s3_server.start()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture()
def bucket(s3, request):
    from pyarrow import fs as pafs

    name = "b-" + request.node.name.replace("_", "-")[:50].lower().strip("-")
    pafs.S3FileSystem(endpoint_override=s3["AWS_ENDPOINT_URL"], allow_bucket_creation=True).create_dir(name)
    return name


def s3fs():
    from pyarrow import fs as pafs

    return pafs.FileSystem.from_uri("s3://x")[0]


def put_inputs(bucket: str) -> list[str]:
    """Hive-partitioned inputs on S3: JSONL (one bad line) under year=2024/, Parquet under year=2025/."""
    fs = s3fs()
    rows = [{"doc_id": f"d{i:03d}", "text": f"invoice {i} total {i * 3}", "title": f"T{i}"} for i in range(N)]
    with fs.open_output_stream(f"{bucket}/in/year=2024/month=01/a.jsonl") as f:
        f.write(("".join(json.dumps(r) + "\n" for r in rows[:12]) + "{broken\n").encode())
    pq.write_table(pa.Table.from_pylist(rows[12:]), f"{bucket}/in/year=2025/month=11/b.parquet", filesystem=fs)
    return [r["doc_id"] for r in rows]


def job(model: Path, bucket: str, out: str = "out/extract", **output) -> dict:
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": f"s3://{bucket}/in/", "id_column": "doc_id"},
        "output": {"path": f"s3://{bucket}/{out}", "keep_columns": ["title", "year", "month"], "rows_per_part": 3, **output},
        "prompt": {"template": "{{ year }}-{{ month }}: {{ text }}"},
        "sampling": {"max_tokens": 3},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 64},
    }


def s3_parts(bucket: str, out: str = "out/extract") -> list[str]:
    return sorted(f.name for f in location(f"s3://{bucket}/{out}").files())


def manifest_parts(uri: str) -> int:
    """Parts in the run's manifest so far (read while the run writes it). moto's server answered a
    read made during the run's PUT with half the object once, under load (S3 itself swaps whole
    objects; moto's FakeKey rewrites its buffer in place): such a read counts as no part yet, and the
    poll reads again."""
    m = layout.manifest_path(uri)
    try:
        return len(json.loads(m.read_text())["parts"]) if m.exists() else 0
    except json.JSONDecodeError:
        return 0


def read_back(bucket: str, out: str = "out/extract") -> pa.Table:
    return ds.dataset(f"s3://{bucket}/{out}", format="parquet").to_table()


class Boom(RuntimeError):
    pass


def test_s3_run_fails_mid_way_and_resumes_exactly_once(tiny_model, bucket, engines):
    ids = put_inputs(bucket)
    uri = f"s3://{bucket}/out/extract"

    def fault(progress) -> None:
        if manifest_parts(uri) >= 2:
            raise Boom("fault injected")

    with pytest.raises(Boom):
        batchinfer.run(job(tiny_model, bucket), engine_factory=engines, on_progress=fault)
    first = read_back(bucket)
    done = first.column("doc_id").to_pylist()
    assert 6 <= len(done) < N and len(set(done)) == len(done)
    assert s3_parts(bucket) == [f"part-{i:06d}.parquet" for i in range(len(s3_parts(bucket)))]  # parts only
    assert not layout.lock_path(uri).exists()  # the failed run released its lease
    # a kill between a part's upload and the manifest write: the manifest misses the last part
    m = mf.Manifest.load(uri)
    last = m.parts.pop()
    m.save()

    s = batchinfer.run(job(tiny_model, bucket), engine_factory=engines)
    assert s.recovered_parts == 1 and s.this_run_rows == N - len(done) and s.rows_done == N and s.rejects == 1
    table = read_back(bucket)
    assert sorted(table.column("doc_id").to_pylist()) == ids  # every id exactly once
    assert table.schema.field("year").type == pa.int32() and table.schema.field("month").type == pa.int32()
    years = dict(zip(table.column("doc_id").to_pylist(), table.column("year").to_pylist()))
    assert {years[i] for i in ids[:12]} == {2024} and {years[i] for i in ids[12:]} == {2025}
    assert last.name in s3_parts(bucket)
    rejects = [json.loads(x) for x in layout.rejects_path(uri).read_text().splitlines()]
    assert [(r["line"], r["file"]) for r in rejects] == [(13, f"s3://{bucket}/in/year=2024/month=01/a.jsonl")]
    assert json.loads(layout.report_json_path(uri).read_text())["totals"]["rows"] == N
    assert f"rows {N} " in batchinfer.observe.report_command(uri)  # `batchinfer report s3://...`
    assert batchinfer.run(job(tiny_model, bucket), engine_factory=engines).nothing_to_do


@pytest.mark.slow
def test_s3_run_killed_by_sigkill_then_resumed(tiny_model, bucket, tmp_path):
    ids = put_inputs(bucket)
    uri = f"s3://{bucket}/out/killed"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(tiny_model, bucket, "out/killed", seconds_per_part=0.2)))
    p = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "run", str(path), "-q"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while manifest_parts(uri) < 1 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, f"the run ended before the kill:\n{p.communicate()[0]}"
    with pytest.raises(JobError, match="another batchinfer run"):  # its lease guards the output
        mf.lock_output(uri)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert layout.lock_path(uri).exists()  # a dead run leaves its lease; the resume takes it over (same host, pid gone)
    done = read_back(bucket, "out/killed").column("doc_id").to_pylist()
    assert 3 <= len(done) < N and len(done) == len(set(done))
    s = batchinfer.run(path)
    assert s.rows_done == N and s.this_run_rows + len(done) >= N
    assert sorted(read_back(bucket, "out/killed").column("doc_id").to_pylist()) == ids


def test_s3_report_page_drawn_by_the_detached_writer(tiny_model, bucket, engines):
    """report_page "detached" (the CLI's default): report.json on S3 when the run returns, the page
    drawn there by a process of its own (the store's credentials reach it through the environment)."""
    put_inputs(bucket)
    uri = f"s3://{bucket}/out/extract"
    s = batchinfer.run(job(tiny_model, bucket), engine_factory=engines, report_page="detached")
    assert s.rows_done == N and layout.report_json_path(uri).exists()
    page = layout.report_html_path(uri)
    deadline = time.monotonic() + 120
    while not page.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "<img" in page.read_text()


def test_s3_writes_are_whole_or_absent(bucket):
    target = location(f"s3://{bucket}/w/obj.bin")
    with pytest.raises(Boom):
        with target.open_atomic() as fh:
            fh.write(b"x" * 1000)
            raise Boom("half way")
    assert not target.exists() and not location(f"s3://{bucket}/w").files()
    big = os.urandom(12 * 2**20)  # above one multipart upload part
    target.write_atomic(big)
    assert target.read_bytes() == big and [f.name for f in location(f"s3://{bucket}/w").files()] == ["obj.bin"]


def test_s3_lease(bucket):
    lock = location(f"s3://{bucket}/l/lock")
    held = lock.lock("out")
    with pytest.raises(LockedError, match="another batchinfer run"):
        lock.lock("out")
    held.close()
    assert not lock.exists()
    again = lock.lock("out")  # free again
    again.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = json.loads('{"token": "t", "pid": 0, "heartbeat": 0}')
    body.update(host=__import__("socket").gethostname(), pid=int(dead.stdout), heartbeat=time.time())
    lock.write_text(json.dumps(body))
    taken = lock.lock("out")  # held by a process of this host that is gone: taken over
    taken.close()


def test_s3_glob_and_folder_listing(bucket):
    put_inputs(bucket)
    root, found = expand_glob(f"s3://{bucket}/in/**/*.jsonl")
    assert str(root) == f"s3://{bucket}/in" and [f.uri for f in found] == [f"s3://{bucket}/in/year=2024/month=01/a.jsonl"]
    files = list_input_files(f"s3://{bucket}/in/")
    assert [(f.format, dict(f.partitions)) for f in files] == [("jsonl", {"year": 2024, "month": 1}), ("parquet", {"year": 2025, "month": 11})]
    with pytest.raises(Exception, match="no files match"):
        list_input_files(f"s3://{bucket}/in/*.csv")


def test_fsspec_store_runs_a_job(tiny_model, engines):
    """memory:// is served by fsspec (pyarrow has no such scheme), through the same Location interface."""
    import fsspec

    mem = fsspec.filesystem("memory")
    rows = [{"doc_id": i, "text": f"doc {i}"} for i in range(7)]
    with mem.open("/jobs/in/part=a/x.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": "memory://jobs/in", "id_column": "doc_id"},
        "output": {"path": "memory://jobs/out/x", "keep_columns": ["part"], "rows_per_part": 3},
        "prompt": {"template": "{{ text }}"},
        "sampling": {"max_tokens": 2},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 32},
    }
    s = batchinfer.run(spec, engine_factory=engines)
    assert s.rows_done == 7
    names = sorted(p.rsplit("/", 1)[-1] for p in mem.find("/jobs/out/x"))
    assert names == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert mem.exists("/jobs/out/_x.batchinfer/manifest.json")
    with mem.open("/jobs/out/x/part-000000.parquet", "rb") as fh:
        assert pq.read_table(fh).column("part").to_pylist() == ["a"] * 3
    assert batchinfer.run(spec, engine_factory=engines).nothing_to_do


@pytest.mark.parametrize("pattern", ["*.jsonl", "**/*.jsonl", "a/*", "a/**", "*/b/*.parquet", "**/x?.jsonl", "[ab]/**/*", "nothing/*"])
def test_glob_matches_pythons_glob(tmp_path, pattern):
    for name in ("x1.jsonl", "x2.jsonl", ".hidden.jsonl", "a/x3.jsonl", "a/b/y.parquet", "a/.h/z.jsonl", "c/b/w.parquet", "b/q.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    want = sorted(p for p in globlib.glob(str(tmp_path / pattern), recursive=True) if os.path.isfile(p))
    assert [f.uri for f in expand_glob(str(tmp_path / pattern))[1]] == want


def test_relative_paths_follow_the_job_file_and_uris_stay_uris(tmp_path):
    (tmp_path / "jobs").mkdir()
    base = {"model": "m", "prompt": {"template": "x"}}
    spec = load_job({**base, "input": {"path": "data/*.parquet", "id_column": "id"}, "output": {"path": "out/x"}}, base_dir=tmp_path / "jobs")
    assert spec.input.path == str(tmp_path / "jobs" / "data" / "*.parquet") and spec.output.path == str(tmp_path / "jobs" / "out" / "x")
    spec = load_job({**base, "input": {"path": "s3://bkt/docs/*.parquet", "id_column": "id"}, "output": {"path": "gs://b/out/"}}, base_dir=tmp_path)
    assert spec.input.path == "s3://bkt/docs/*.parquet" and spec.output.path == "gs://b/out/"
    assert str(layout.records_dir("s3://bkt/a/out/")) == "s3://bkt/a/_out.batchinfer"
    with pytest.raises(Exception, match="below a root or bucket"):
        layout.records_dir("s3://bkt")


def test_rows_from_s3_and_local_are_the_same(tmp_path, bucket):
    put_inputs(bucket)
    fs = s3fs()
    from pyarrow import fs as pafs

    pafs.copy_files(f"{bucket}/in", str(tmp_path / "in"), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())

    def rows(path: str) -> list:
        return [(r.values, r.line) for b in iter_rows(list_input_files(path), "doc_id", 5) for r in b if hasattr(r, "values")]

    assert rows(f"s3://{bucket}/in") == rows(str(tmp_path / "in")) and len(rows(str(tmp_path / "in"))) == N
