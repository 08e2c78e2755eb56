"""See inside a run: step/row records, the report page, Prometheus metrics, token-id logs, traces,
and two runs compared.

Entry points for the driver and CLI:
  Observer(ObserveOptions(...))  on_step / on_result / on_row / close (observer.py)
  row_metrics(result)            queue_wait_s, ttft_s, decode_s of one row (records.py)
  report_command(out_dir)        `batchinfer report OUT_DIR`: rewrite the report, return its summary
  read_token_ids(out_dir)        the `--log-token-ids` sidecar as a polars frame
  compare_runs(out_a, out_b)     `batchinfer compare`: a typed Comparison (compare.py)
"""

from batchinfer.observe.compare import Comparison, compare_runs
from batchinfer.observe.observer import ObserveOptions, Observer, clear_records
from batchinfer.observe.records import row_metrics
from batchinfer.observe.report import report_command, write_report
from batchinfer.observe.tokenlog import read_token_ids

__all__ = [
    "Comparison", "ObserveOptions", "clear_records", "compare_runs", "Observer", "read_token_ids", "report_command",
    "row_metrics", "write_report",
]
