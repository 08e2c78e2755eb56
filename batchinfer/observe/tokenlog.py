"""`--log-token-ids`: every row's prompt and output token ids in a Parquet sidecar.

Tokenizer and chat-template bugs (a missing BOS, a doubled special token, a template that drops the
system message) show up here first: decode the ids and compare with what you meant to send.

Layout: `token_ids_dir(out)/part-<run_id>-<n>.parquet` (in the records folder beside the output: io/layout.py), columns id (string), prompt_token_ids
list<int32>, output_token_ids list<int32>; parts are written as the run goes (see records.PartSink),
so a dead run keeps what it logged. `read_token_ids` keeps the last record of each id.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa

from batchinfer.engine.request import Result
from batchinfer.io import layout
from batchinfer.io.layout import TOKEN_IDS_DIR, token_ids_dir  # noqa: F401  (name re-exported)
from batchinfer.observe.records import PartSink, SinkConfig, read_parts

TOKEN_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
    ]
)


class TokenLog:
    """Streams (id, prompt ids, output ids) of each finished row into `token_ids/` parts."""

    def __init__(self, out_dir: Any, run_id: str, flush_rows: int = 2_000, flush_s: float = 30.0) -> None:
        self.folder = layout.token_ids_dir(out_dir)
        self._sink = PartSink(SinkConfig(self.folder, TOKEN_SCHEMA, run_id, flush_rows, flush_s))

    def add(self, row_id: Any, result: Result) -> None:
        self._sink.add(
            {
                "id": str(row_id),
                "prompt_token_ids": list(result.prompt_token_ids),
                "output_token_ids": list(result.output_token_ids),
            }
        )

    def close(self) -> None:
        self._sink.flush()

    def compact(self) -> None:
        """Flush and merge this run's parts into one (at the end of a run)."""
        self._sink.compact()


def scan_token_ids(out_dir: Any) -> pl.LazyFrame:
    """All logged rows of an output folder, lazily, the last record of each id (empty if none)."""
    return read_parts(layout.token_ids_dir(out_dir), TOKEN_SCHEMA).lazy().unique(subset="id", keep="last", maintain_order=True)


def read_token_ids(out_dir: Any) -> pl.DataFrame:
    """All logged rows of an output folder, the last record of each id (empty frame if none)."""
    return scan_token_ids(out_dir).collect()
