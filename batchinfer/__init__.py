"""batchinfer: offline, high-throughput batch document processing with LLMs.

`batchinfer.run(job)` runs a batch job (a YAML path, a dict or a JobSpec) and returns its RunSummary.
The job layer is imported when it is first called, so `import batchinfer` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from batchinfer.job.spec import JobSpec
    from batchinfer.job.summary import RunSummary

__version__ = "0.1.0"
__all__ = ["run", "__version__"]


def run(job: "str | Path | dict[str, Any] | JobSpec", *args: Any, **kwargs: Any) -> "RunSummary":
    """Run a batch job to completion and return its summary: `batchinfer.job.driver.run_job` (same arguments)."""
    from batchinfer.job.driver import run_job

    return run_job(job, *args, **kwargs)
