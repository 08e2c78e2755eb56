"""Stage 4 of a job: an engine Result (or a row error) becomes an output row; answers are validated."""

from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from batchinfer.engine.request import Result
from batchinfer.io.writer import RESULT_FIELDS
from batchinfer.job.spec import JobSpec
from batchinfer.observe import row_metrics
from batchinfer.job.requests import RowMeta

RESULT_NAMES = frozenset(f.name for f in RESULT_FIELDS)  # the engine's columns of an output row


# ---- stage 4: results to output rows -----------------------------------------------------------------


class ResultConverter:
    """Stage 4: an engine Result (or a row error) becomes an output row; JSON answers are checked."""

    def __init__(self, spec: JobSpec, constraint: Any) -> None:
        self.constraint = constraint
        self.schema = spec.structured.schema_dict() if spec.structured and spec.structured.json_schema is not None else None
        self.output_type: pa.DataType | None = None
        self._to_arrow: Callable[[Any], Any] | None = None
        if self.schema is not None:
            self.output_type, self._to_arrow = _arrow_mapping(self.schema)

    def error_row(self, meta: RowMeta, message: str) -> dict[str, Any]:
        row = dict(meta.keys)
        row.update(output_text=None, finish_reason="error", prompt_tokens=meta.prompt_tokens, completion_tokens=0, error=message)
        row.update(row_metrics(None))  # never reached the engine: no timings
        if self.schema is not None:
            row["output"] = None
        return row

    def row(self, meta: RowMeta, result: Result) -> dict[str, Any]:
        out = dict(meta.keys)
        out.update(
            output_text=result.text if result.finish_reason != "error" else (result.text or None),
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            error=result.error,
        )
        out.update(row_metrics(result))  # queue_wait_s, ttft_s, decode_s
        if result.finish_reason == "error" and not out["error"]:
            out["error"] = "the engine failed this row without a message"
        if self.constraint is not None and result.finish_reason != "error":
            value, err = _validate(self.constraint, result.text)
            if err is not None:
                if result.finish_reason == "length":
                    out["error"] = f"output cut at max_tokens ({result.completion_tokens} tokens) before it matched: {err}"
                else:
                    out["finish_reason"] = "error"
                    out["error"] = f"output does not match the constraint: {err}"
            elif self.schema is not None:
                out["output"] = self._to_arrow(value)  # type: ignore[misc]
        if self.schema is not None:
            out.setdefault("output", None)
        return out


def _arrow_mapping(schema: dict[str, Any]) -> tuple[pa.DataType, Callable[[Any], Any]]:
    """The `output` column type for a JSON schema (an Arrow struct etc.), or JSON text where none fits."""
    from batchinfer.structured.arrow import arrow_type_for_schema, to_arrow_value

    typ = arrow_type_for_schema(schema)
    return (typ if typ is not None else pa.string()), (lambda v: to_arrow_value(v, schema))


def _validate(constraint: Any, text: str) -> tuple[Any, str | None]:
    from batchinfer.structured.validate import validate_output

    return validate_output(constraint, text)
