"""The CLI: help, exit codes, --set, validate, plan, demo-model, the quickstart job."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import yaml
from typer.testing import CliRunner

from batchinfer.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture()
def job_file(tiny_model, tmp_path):
    rows = [{"doc_id": f"d{i}", "text": f"invoice {i} total {i * 3}"} for i in range(6)]
    lines = [json.dumps(r) for r in rows] + [json.dumps({"doc_id": "d-bad", "body": "no text column"})]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": "docs.jsonl", "id_column": "doc_id"},
        "output": {"path": "out"},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 3},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 32},
    }
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


@pytest.mark.parametrize("cmd", [[], ["run"], ["validate"], ["plan"], ["report"], ["demo-model"]])
def test_help_everywhere(cmd):
    r = invoke(*cmd, "--help")
    assert r.exit_code == 0 and "Usage" in r.output


def test_invalid_job_is_one_message_and_exit_2(tmp_path, job_file):
    data = yaml.safe_load(job_file.read_text())
    data["output"]["colums"] = ["x"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    for args in (["run", bad], ["validate", bad], ["plan", bad], ["run", tmp_path / "missing.yaml"], ["run", job_file, "--set", "nokey"]):
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "error:" in r.output and "Traceback" not in r.output
    assert "unknown key 'output.colums'" in invoke("run", bad).output
    assert invoke("run", job_file, "--max-error-rate", "7").exit_code == 2


def test_run_exit_codes_set_and_resume(job_file, tmp_path):
    r = invoke("run", job_file, "--quiet")
    assert r.exit_code == 3, r.output  # one row of seven has an error; default --max-error-rate 0
    assert "14.3% of rows have errors" in r.output
    df = pl.read_parquet(tmp_path / "out" / "*.parquet")
    assert df.height == 7 and df.filter(pl.col("doc_id") == "d-bad")["error"][0].startswith("template column 'text' is missing")
    r = invoke("run", job_file, "--max-error-rate", "0.2")
    assert r.exit_code == 0 and "nothing to do" in r.output
    r = invoke("run", job_file, "--set", "output.path=out2", "--set", "sampling.max_tokens=2", "--max-error-rate", "0.2", "-q")
    assert r.exit_code == 0, r.output
    out2 = pl.read_parquet(tmp_path / "out2" / "*.parquet")
    assert out2.height == 7 and out2["completion_tokens"].max() <= 2
    r = invoke("run", job_file, "--set", "sampling.max_tokens=5")
    assert r.exit_code == 2 and "different job (changed: sampling)" in r.output
    assert invoke("run", job_file, "--set", "sampling.max_tokens=5", "--overwrite", "--max-error-rate", "1").exit_code == 0


def test_run_failure_is_exit_1(job_file, monkeypatch):
    from batchinfer.engine.engine import Engine

    def boom(self, requests):
        raise RuntimeError("CUDA error: device lost")
        yield  # pragma: no cover

    monkeypatch.setattr(Engine, "generate", boom)
    r = invoke("run", job_file, "-q")
    assert r.exit_code == 1 and "the run failed: RuntimeError: CUDA error: device lost" in r.output


def test_validate_and_plan(job_file, tiny_model):
    r = invoke("validate", job_file)
    assert r.exit_code == 0, r.output
    assert "job ok" in r.output and "7 rows with an id" in r.output and "rendered on 5 of the first 5 rows" in r.output
    r = invoke("plan", job_file)
    assert r.exit_code == 0, r.output
    from batchinfer.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model)
    msgs = [[{"role": "user", "content": f"Doc: invoice {i} total {i * 3}"}] for i in range(6)]
    expected = sum(len(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]) for m in msgs)
    assert "rows: 6 to do (0 already done, 1 will fail before the engine)" in r.output
    assert f"prompt tokens: {expected} " in r.output
    assert "bytes per token (2 layers x 2 kv heads x 32 x 2 x 4 B)" in r.output
    assert "time on cpu: at least" in r.output and "assumptions:" in r.output
    assert "the engine's KV cache on cpu: about 512 tokens" in r.output  # num_kv_blocks 32 x block 16
    # without num_kv_blocks: engine/kv_budget.py's CPU budget, what the engine itself allocates
    r = invoke("plan", job_file, "--set", "engine.num_kv_blocks=null", "--set", "engine.kv_cache_gib=0.001")
    assert r.exit_code == 0, r.output
    per_block = 16 * 2 * 2 * 2 * 32 * 4
    assert f"the engine's KV cache on cpu: about {(1 << 30) // 1000 // per_block * 16} tokens" in r.output


def test_validate_refuses_a_template_that_fails_on_every_row(job_file):
    r = invoke("validate", job_file, "--set", "prompt.template={{ missing_col }}")
    assert r.exit_code == 2 and "fails on every sampled row" in r.output and "missing_col" in r.output


def test_validate_refuses_a_bad_schema(job_file):
    r = invoke("validate", job_file, "--set", "structured.regex=(unclosed")
    assert r.exit_code == 2 and "Traceback" not in r.output


# llguidance refuses `not`; auto compiles it with another backend (tests/test_structured.py)
NOT_SCHEMA = '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}'


def test_validate_compiles_with_the_backend_the_engine_uses(job_file, tmp_path):
    """One grammar backend setting: a schema the job's backend cannot compile fails at validate and before
    the run's engine (exit 2, no output rows), whether set as structured.backend or the old engine.grammar_backend."""
    schema = ("--set", f"structured.json_schema={NOT_SCHEMA}")
    r = invoke("validate", job_file, *schema)
    assert r.exit_code == 0 and "constraint compiles (auto backend)" in r.output, r.output
    for key in ("structured.backend", "engine.grammar_backend"):
        r = invoke("validate", job_file, *schema, "--set", f"{key}=llguidance")
        assert r.exit_code == 2, (key, r.output)
        assert "llguidance" in r.output and "not" in r.output and "Traceback" not in r.output
        r = invoke("run", job_file, *schema, "--set", f"{key}=llguidance", "--set", f"output.path={tmp_path / key}", "-q")
        assert r.exit_code == 2 and "llguidance" in r.output, (key, r.output)
        assert not list((tmp_path / key).glob("*.parquet"))


def test_quickstart_job_validates(tiny_model, tmp_path):
    r = invoke("validate", ROOT / "jobs" / "quickstart.yaml", "--set", f"model.path={tiny_model}", "--set", f"output.path={tmp_path / 'q'}")
    assert r.exit_code == 0, r.output
    assert "24 rows with an id" in r.output and "constraint compiles" in r.output


def test_demo_model_command(tmp_path):
    r = invoke("demo-model", tmp_path / "m", "--family", "llama", "--vocab-size", "300")
    assert r.exit_code == 0 and (tmp_path / "m" / "config.json").exists()
    assert invoke("demo-model", tmp_path / "m2", "--family", "gpt2").exit_code == 2


def test_python_api_accepts_a_dict(job_file, tmp_path):
    import batchinfer

    job = yaml.safe_load(job_file.read_text())
    job["input"]["path"] = str(tmp_path / "docs.jsonl")
    job["output"]["path"] = str(tmp_path / "api-out")
    s = batchinfer.run(job)
    assert s.rows_done == 7 and s.error_rows == 1 and s.error_rate == pytest.approx(1 / 7)
    # the same job as a JobSpec and as a YAML path: already done
    from batchinfer.job import load_job

    assert batchinfer.run(load_job(job)).nothing_to_do
    path = tmp_path / "api.yaml"
    path.write_text(yaml.safe_dump(job))
    assert batchinfer.run(path, ["sampling.max_tokens=3"]).nothing_to_do


def test_import_batchinfer_is_cheap_and_run_is_a_function():
    import subprocess
    import sys

    code = ("import sys, types, batchinfer; assert isinstance(batchinfer.run, types.FunctionType); "
            "loaded = [m for m in sys.modules if m.startswith('batchinfer.')]; assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_version():
    from importlib import metadata

    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"batchinfer {metadata.version('batchinfer')}"


def test_help_shows_the_ray_extra_literally():
    r = invoke("run", "--help")
    assert "pip install 'batchinfer[ray]'" in " ".join(r.stdout.split())


def last_json(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_summary_json_is_the_last_stdout_line_for_every_outcome(job_file, tmp_path):
    r = invoke("run", job_file, "-q", "--summary-json")  # one row of seven has an error: exit 3
    s = last_json(r)
    assert r.exit_code == 3 and s["exit_code"] == 3 and s["status"] == "too_many_errors"
    assert s["rows_done"] == 7 and s["error_rows"] == 1 and s["error_rate"] == pytest.approx(1 / 7)
    assert s["output_path"] == str(tmp_path / "out") and "done:" not in r.stdout and "done:" in r.stderr
    r = invoke("run", job_file, "--summary-json", "--max-error-rate", "0.5")
    assert r.exit_code == 0 and last_json(r)["status"] == "nothing_to_do" and last_json(r)["this_run_rows"] == 0
    r = invoke("run", job_file, "--summary-json", "--set", "sampling.max_tokens=9")
    assert r.exit_code == 2 and last_json(r)["status"] == "invalid" and "different job" in last_json(r)["error"]
    # CliRunner's stdout is not a terminal: JSON by default; --no-summary-json keeps the human text on stdout
    assert last_json(invoke("run", job_file, "--max-error-rate", "0.5"))["status"] == "nothing_to_do"
    r = invoke("run", job_file, "--no-summary-json", "--max-error-rate", "0.5")
    assert r.exit_code == 0 and r.stdout.startswith("nothing to do") and "{" not in r.stdout


def test_summary_json_on_a_failed_run(job_file, monkeypatch):
    from batchinfer.engine.engine import Engine

    def boom(self, requests):
        raise RuntimeError("device lost")
        yield  # pragma: no cover

    monkeypatch.setattr(Engine, "generate", boom)
    r = invoke("run", job_file, "-q", "--summary-json")
    assert r.exit_code == 1 and last_json(r) == {"status": "failed", "exit_code": 1, "error": "the run failed: RuntimeError: device lost"}
