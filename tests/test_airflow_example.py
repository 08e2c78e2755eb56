"""examples/airflow_dag.py: Airflow 3 imports, and its run helper retries only what a retry can fix.

Airflow itself is not a test dependency: the helper (`RETRYABLE`, `batchinfer_run`) is taken from the
example's own source and run against the real CLI; only Airflow's exception class is a local one
when Airflow is not installed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "airflow_dag.py"


class AirflowFailException(Exception):  # airflow.sdk.exceptions.AirflowFailException when Airflow is installed
    pass


def helper(command: list[str]):
    """The example's RETRYABLE and batchinfer_run, compiled from its source, calling `command`."""
    tree = ast.parse(EXAMPLE.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "batchinfer_run")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "RETRYABLE" for t in n.targets))]
    assert len(keep) == 2
    try:
        from airflow.sdk.exceptions import AirflowFailException as fail
    except ImportError:
        fail = AirflowFailException
    ns = {"json": json, "subprocess": subprocess, "AirflowFailException": fail, "BATCHINFER": command}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(EXAMPLE), "exec"), ns)
    return ns["batchinfer_run"], fail


def test_the_dag_uses_airflow_3_imports():
    tree = ast.parse(EXAMPLE.read_text())
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("airflow.providers.standard.operators.bash", "BashOperator") in imports
    assert ("airflow.sdk", "DAG") in imports and ("airflow.sdk", "task") in imports
    assert ("airflow.sdk.exceptions", "AirflowFailException") in imports
    assert not [m for m, _ in imports if m and m.startswith(("airflow.operators", "airflow.models"))]
    assert "retries=3" in EXAMPLE.read_text() and '"retries": 3' not in EXAMPLE.read_text()  # not for every task


@pytest.mark.slow
def test_run_helper_returns_the_summary_and_fails_fast_on_3(tiny_model, tmp_path):
    rows = [{"doc_id": f"d{i}", "text": f"doc {i}"} for i in range(4)] + [{"doc_id": "bad"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model), "dtype": "float32"}, "input": {"path": "in.jsonl", "id_column": "doc_id"},
        "output": {"path": "out"}, "prompt": {"template": "{{ text }}"}, "sampling": {"max_tokens": 2},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 32},
    }))
    run, fail = helper([sys.executable, "-m", "batchinfer.cli"])
    summary = run(str(job), "-q", "--max-error-rate", "0.5")
    assert summary["status"] == "done" and summary["rows_done"] == 5 and summary["error_rows"] == 1
    assert summary["output_path"] == str(tmp_path / "out")
    with pytest.raises(fail, match="exited with 3"):  # one row of five has an error: a retry cannot help
        run(str(job), "-q")


@pytest.mark.parametrize("code", ["import sys; sys.exit(1)", "import sys; sys.exit(75)", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
def test_run_helper_retries_exit_1_and_a_killed_run(code):
    run, fail = helper([sys.executable, "-c", code, "--"])
    with pytest.raises(RuntimeError) as e:
        run("job.yaml")
    assert not isinstance(e.value, fail)


def test_run_helper_fails_fast_on_exit_2():  # the CLI's exit-2 cases are tests/test_cli.py's
    run, fail = helper([sys.executable, "-c", 'print(\'{"status": "invalid", "error": "bad key"}\'); raise SystemExit(2)', "--"])
    with pytest.raises(fail, match="exited with 2: bad key"):
        run("job.yaml")
