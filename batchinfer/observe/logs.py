"""Log lines for log collectors (`--log-format json`): one JSON object per line on stderr.

Every record becomes {"time", "level", "logger", "message"} plus the numbers a record carries in its
`fields` extra (progress lines: rows_done, rows_total, rows_per_s, output_tokens_per_s, eta_s,
errors; the run's phases at exit), and "exception" when it has a traceback.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

FIELDS = "fields"  # the LogRecord attribute (logging's `extra`) whose dict is merged into the object


class JsonFormatter(logging.Formatter):
    """Formats a LogRecord as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            obj.update({k: v for k, v in fields.items() if k not in obj})
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


def log_formatter(log_format: str) -> logging.Formatter:
    """text: the message alone (the CLI's plain lines); json: JsonFormatter. ValueError for other names."""
    if log_format == "text":
        return logging.Formatter("%(message)s")
    if log_format == "json":
        return JsonFormatter()
    raise ValueError(f"--log-format must be text or json, not {log_format!r}")
