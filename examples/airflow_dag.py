"""An Airflow 3 DAG that runs one batchinfer job per day on that day's shards.

The dated paths come in through `--set`, so one job file serves every day. A rerun of `batchinfer run`
resumes: it does only the rows missing from the output, none twice. Its exit code says whether a
retry can help, and only those failures are retried:
  1   the run failed (a crash, a lost GPU, a killed engine worker): retried, and the retry resumes;
      a run killed by a signal (e.g. the OOM killer) is retried the same way;
  75  the run was stopped (SIGTERM/SIGINT, --stop-after) after committing what it had finished:
      retried, and the retry resumes;
  2   invalid job, data or arguments: fails at once (the same job fails the same way again);
  3   the run finished, but more rows than --max-error-rate have errors: fails at once (the output
      is complete; a rerun would only say "nothing to do").
The run's summary (`--summary-json`: one JSON line, the last on stdout) is the `run` task's return
value, so it is its XCom (rows_done, error_rows, error_rate, output_path, tokens, seconds, ...).
"""

from __future__ import annotations

import json
import subprocess

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowFailException

JOB = "/opt/jobs/extract.yaml"
BATCHINFER = ["batchinfer"]  # the command (e.g. ["/opt/venvs/batchinfer/bin/batchinfer"])
RETRYABLE = {1, 75}  # exit codes a retry can fix (and death by a signal): the retry resumes


def batchinfer_run(*args: str) -> dict:
    """`batchinfer run ARGS --summary-json`; its summary, or an exception that Airflow retries only for exit 1."""
    proc = subprocess.run([*BATCHINFER, "run", *args, "--summary-json"], stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()  # progress and log lines went to stderr (the task log)
    try:
        summary = json.loads(lines[-1]) if lines else {}
    except ValueError:
        summary = {}
    if proc.returncode == 0:
        return summary
    message = f"batchinfer run exited with {proc.returncode}: {summary.get('error') or 'no summary'}"
    if proc.returncode in RETRYABLE or proc.returncode < 0:
        raise RuntimeError(message)  # up for retry: the next try resumes
    raise AirflowFailException(message)  # no retry


with DAG(
    dag_id="batchinfer_daily_extract",
    schedule="@daily",
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    day = ["--set", "input.path=/data/docs/{{ ds }}/*.parquet", "--set", "output.path=/data/extract/{{ ds }}/"]

    validate = BashOperator(  # exit 2 means the job must be fixed: no retries
        task_id="validate",
        bash_command=f"{' '.join(BATCHINFER)} validate {JOB} {' '.join(day)}",
        retries=0,
    )

    @task(retries=3, retry_delay=pendulum.duration(minutes=5))
    def run(ds: str | None = None) -> dict:
        return batchinfer_run(JOB, "--quiet", "--max-error-rate", "0.01",
                              "--set", f"input.path=/data/docs/{ds}/*.parquet", "--set", f"output.path=/data/extract/{ds}/")

    announce = BashOperator(
        task_id="announce",
        bash_command=(
            "echo \"{{ ti.xcom_pull(task_ids='run')['rows_done'] }} rows, "
            "{{ ti.xcom_pull(task_ids='run')['error_rows'] }} with errors, in {{ ti.xcom_pull(task_ids='run')['output_path'] }}\""
        ),
    )

    validate >> run() >> announce
