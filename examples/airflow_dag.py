"""An Airflow DAG that runs one batchinfer job per day on that day's shards.

The dated paths come in through `--set`, so one job file serves every day. A retry after a crash
(or a killed worker) resumes: only rows missing from the output are done, none twice.
Exit codes: 0 done, 1 run failed (retry), 2 invalid job (fix it), 3 too many rows with errors,
75 stopped by SIGTERM/SIGINT or --stop-after (retry: it resumes).
"""

from __future__ import annotations

import pendulum
from airflow import DAG
from airflow.operators.bash import BashOperator

with DAG(
    dag_id="batchinfer_daily_extract",
    schedule="@daily",
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 3, "retry_delay": pendulum.duration(minutes=5)},
) as dag:
    validate = BashOperator(
        task_id="validate",
        bash_command=(
            "batchinfer validate /opt/jobs/extract.yaml "
            "--set input.path=/data/docs/{{ ds }}/*.parquet --set output.path=/data/extract/{{ ds }}/"
        ),
    )
    run = BashOperator(
        task_id="run",
        bash_command=(
            "batchinfer run /opt/jobs/extract.yaml --quiet --max-error-rate 0.01 "
            "--set input.path=/data/docs/{{ ds }}/*.parquet --set output.path=/data/extract/{{ ds }}/"
        ),
    )
    validate >> run
