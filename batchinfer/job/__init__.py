"""The job layer: a job file's spec, its plan, the row stages, the executors and the driver of a whole job.

The public names are re-exported here and imported on first use (PEP 562), so `import batchinfer.job`
stays cheap and the submodules can import each other without going through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JobSpec": "spec",
    "JobError": "spec",
    "load_job": "spec",
    "run_job": "driver",
    "make_engine": "stage",
    "RunError": "stage",
    "RunSummary": "summary",
    "RowRecord": "summary",
    "Progress": "summary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
