"""Parts committed on a background thread (io/background_writer.py): in order, each complete or absent,
callbacks on the caller's thread, a bounded queue, a failure raised where the rows are added."""

from __future__ import annotations

import threading
import time

import polars as pl
import pyarrow as pa
import pytest

from batchinfer.io.background_writer import BackgroundPartWriter
from batchinfer.io.manifest import Manifest

COLUMNS = {"doc_id": pa.string(), "output_text": pa.string(), "error": pa.string()}


def _row(i: int) -> dict:
    return {"doc_id": f"d{i:03d}", "output_text": f"answer {i}", "error": None}


def _manifest(tmp_path) -> Manifest:
    m = Manifest(tmp_path, "fp-test", {}, "doc_id")
    m.save()
    return m


def test_parts_are_committed_in_order_and_callbacks_run_on_the_callers_thread(tmp_path):
    m = _manifest(tmp_path)
    calls = []
    w = BackgroundPartWriter(m, COLUMNS, rows_per_part=3, seconds_per_part=3600,
                             on_commit=lambda part: calls.append((part.name, threading.get_ident())))
    for i in range(10):
        w.add(_row(i))
    w.close()
    assert [p.name for p in m.parts] == [f"part-{k:06d}.parquet" for k in range(4)]
    assert [p.rows for p in m.parts] == [3, 3, 3, 1]
    assert [c[0] for c in calls] == [p.name for p in m.parts]
    assert {c[1] for c in calls} == {threading.get_ident()}
    ids = [i for p in m.parts for i in pl.read_parquet(tmp_path / p.name)["doc_id"].to_list()]
    assert ids == [f"d{i:03d}" for i in range(10)]  # every row once, in the order added
    assert Manifest.load(tmp_path).parts == m.parts  # recorded on disk too
    assert not list(tmp_path.glob("_tmp.*"))


def test_a_failed_commit_is_raised_on_the_callers_thread_and_nothing_after_it_is_committed(tmp_path, monkeypatch):
    m = _manifest(tmp_path)
    w = BackgroundPartWriter(m, COLUMNS, rows_per_part=2, seconds_per_part=3600)
    real = BackgroundPartWriter.commit
    n = [0]

    def commit(self, rows):
        n[0] += 1
        if n[0] == 2:
            raise OSError("disk full")
        return real(self, rows)

    monkeypatch.setattr(BackgroundPartWriter, "commit", commit)
    with pytest.raises(OSError, match="disk full"):
        for i in range(20):
            w.add(_row(i))
            time.sleep(0.01)
        w.close()
    assert [p.rows for p in m.parts] == [2]  # the first part only: the lost one is not skipped over
    assert w.broken
    w.save_finished()  # after the failure: logs, does not raise, commits nothing more
    assert len(m.parts) == 1 and len(list(tmp_path.glob("part-*.parquet"))) == 1


def test_the_queue_is_bounded_when_the_disk_is_slower_than_the_engine(tmp_path, monkeypatch):
    m = _manifest(tmp_path)
    w = BackgroundPartWriter(m, COLUMNS, rows_per_part=1, seconds_per_part=3600, max_queued=2)
    gate = threading.Event()
    real = BackgroundPartWriter.commit

    def slow_commit(self, rows):
        gate.wait()
        return real(self, rows)

    monkeypatch.setattr(BackgroundPartWriter, "commit", slow_commit)
    added = [0]

    def engine():
        for i in range(6):
            w.add(_row(i))
            added[0] += 1

    t = threading.Thread(target=engine)
    t.start()
    time.sleep(0.5)
    # one part held by the writer thread, two in the queue, the next add blocks
    assert added[0] == 3 and t.is_alive() and w._parts.qsize() == 2
    gate.set()
    t.join(timeout=30)
    w.close()
    assert [p.name for p in m.parts] == [f"part-{k:06d}.parquet" for k in range(6)]


def test_untyped_columns_are_inferred_from_the_first_parts_rows(tmp_path):
    import pyarrow.parquet as pq

    m = _manifest(tmp_path)
    w = BackgroundPartWriter(m, {**COLUMNS, "doc_id": None}, rows_per_part=2, seconds_per_part=3600)
    for i in range(3):
        w.add({**_row(i), "doc_id": i})
    w.close()
    for p in m.parts:
        assert pq.read_schema(tmp_path / p.name).field("doc_id").type == pa.int64()
    assert [i for p in m.parts for i in pl.read_parquet(tmp_path / p.name)["doc_id"].to_list()] == [0, 1, 2]
