"""Stage 3 ahead of the engine (job/prefetch.py): the same prompts and ids as the serial path, in order,
exactly once, with a bounded number of batches in flight however far ahead the tokenizer could run."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.io.readers import Reject, Row
from batchinfer.job.prefetch import Prefetch, PrefetchConfig
from batchinfer.job.requests import RequestBuilder
from batchinfer.job.spec import load_job

WORDS = ["invoice", "total", "Zürich", "naïve", "42", "—", "line\nbreak", " spaced  out ", "ok", "{{", "é"]


def _spec(tmp_path, chat: bool | None, system: str | None = None):
    return load_job({
        "model": {"path": str(tmp_path)},
        "input": {"path": str(tmp_path / "x.jsonl"), "id_column": "id"},
        "output": {"path": str(tmp_path / "out")},
        "prompt": {"template": "Doc {{ id }}: {{ text }}", "system": system, "chat": chat},
    })


def _items(draw_rows: list[tuple[int, str | None, bool]]) -> list[Row | Reject]:
    """Rows (some without their template column: a RowError) and rejects, in input order."""
    out: list[Row | Reject] = []
    for n, (kind, text, reject) in enumerate(draw_rows):
        if reject:
            out.append(Reject("f.jsonl", n + 1, "not json", "not a JSON object"))
        elif kind == 0 or text is None:
            out.append(Row({"id": n}, "f.jsonl", n + 1))  # no `text`: the template fails on this row
        else:
            out.append(Row({"id": n, "text": text}, "f.jsonl", n + 1))
    return out


def _key(p) -> tuple:
    return (p.item, p.text, None if p.ids is None else list(p.ids), None if p.error is None else str(p.error))


rows_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.one_of(st.none(), st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join)),
              st.integers(0, 9).map(lambda k: k == 0)),  # about one in ten lines is a reject
    max_size=60,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=rows_strategy, batch_rows=st.integers(1, 9), first_rows=st.integers(1, 4), workers=st.integers(1, 3),
       max_batches=st.integers(1, 4), chat=st.sampled_from([None, False]), system=st.sampled_from([None, "Be brief."]))
def test_pipelined_prepare_gives_exactly_the_serial_prompts_and_ids(
    tokenizer, tmp_path, rows, batch_rows, first_rows, workers, max_batches, chat, system
):
    builder = RequestBuilder(_spec(tmp_path, chat, system), tokenizer, 10**6, None)
    items = _items(rows)
    serial = [_key(p) for item in items for p in builder.prepare_batch([item])]
    config = PrefetchConfig(batch_rows=batch_rows, first_rows=first_rows, max_batches=max_batches, workers=workers)
    with Prefetch(iter(items), builder.prepare_batch, config) as ahead:
        piped = [_key(p) for p in ahead]
    assert piped == serial
    # and the requests built from them are the serial path's, with the same ids in the same order
    for n, item in enumerate(items):
        if isinstance(item, Row) and "text" in item.values:
            assert [r.prompt_token_ids for r in builder.build(item, str(n))] == [serial[n][2]]


def test_a_reader_error_comes_after_the_rows_before_it():
    def items():
        yield from range(10)
        raise OSError("disk gone")

    got = []
    with Prefetch(items(), lambda b: [x * 2 for x in b], PrefetchConfig(batch_rows=3, first_rows=1)) as ahead:
        with pytest.raises(OSError, match="disk gone"):
            for x in ahead:
                got.append(x)
    assert got == [2 * x for x in range(10)]


def test_memory_stays_bounded_with_a_tokenizer_far_ahead_of_a_slow_engine():
    pulled = [0]
    lock = threading.Lock()

    def items():
        for n in range(100_000):
            with lock:
                pulled[0] = n + 1
            yield n

    config = PrefetchConfig(batch_rows=16, first_rows=16, max_batches=3, workers=2)
    ahead = Prefetch(items(), lambda b: list(b), config)
    seen = []
    worst_pulled_ahead = 0
    try:
        for x in ahead:  # a slow engine: it takes a row every millisecond
            seen.append(x)
            time.sleep(0.001)
            assert ahead.in_flight <= config.max_batches
            worst_pulled_ahead = max(worst_pulled_ahead, pulled[0] - len(seen))
            if len(seen) == 300:
                break
    finally:
        ahead.close()
    assert seen == list(range(300))
    assert ahead.max_in_flight <= config.max_batches
    assert ahead.max_in_flight == config.max_batches  # it did run as far ahead as allowed
    # in memory at most: the batches in flight, the one being taken, the one the feeder is filling
    assert worst_pulled_ahead <= (config.max_batches + 2) * config.batch_rows
    assert pulled[0] < 300 + (config.max_batches + 2) * config.batch_rows  # close() stopped the reading


def test_close_stops_a_feeder_waiting_for_a_slot():
    ahead = Prefetch(iter(range(10_000)), lambda b: b, PrefetchConfig(batch_rows=1, first_rows=1, max_batches=1))
    t = time.perf_counter()
    ahead.close()  # nothing consumed: the feeder waits for a slot; close must not hang
    assert time.perf_counter() - t < 5
