"""Errors a user can cause exit 2 with one line naming the field, file or spot: a GPU asked for and
absent, an output folder that cannot be written, a YAML syntax error (file:line:column), a KV cache
layout the attention backend cannot read."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from batchinfer.cli import app

runner = CliRunner()


def make_job(tmp: Path, model: Path, **over) -> Path:
    (tmp / "in.jsonl").write_text("".join(json.dumps({"id": i, "text": "t"}) + "\n" for i in range(3)))
    d = {"model": {"path": str(model), "dtype": "float32"}, "input": {"path": "in.jsonl", "id_column": "id"},
         "output": {"path": "out"}, "prompt": {"template": "{{ text }}"}, "sampling": {"max_tokens": 2},
         "engine": {"device": "cpu", "num_kv_blocks": 16}}
    for k, v in over.items():
        d[k] = {**d[k], **v}
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    return job


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]  # (stdout: run's JSON summary line)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_cuda_device_without_a_gpu(tiny_model, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    job = make_job(tmp_path, tiny_model, engine={"device": "cuda"})
    for cmd in ("run", "validate", "plan"):
        line = one_line_error(runner.invoke(app, [cmd, str(job)]))
        assert "engine.device is 'cuda'" in line and "no usable CUDA GPU" in line
    assert "cuda:1" in one_line_error(runner.invoke(app, ["run", str(job), "--set", "engine.device=cuda:1"]))


def _make_unwritable(folder: Path) -> bool:
    """Make `folder` unwritable even for root where possible (immutable attribute), else read-only."""
    if os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return True
    folder.chmod(0o555)
    try:
        (folder / ".w").write_bytes(b"")
    except OSError:
        return True
    (folder / ".w").unlink()
    return False


def _restore(folder: Path) -> None:
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_output_folder_that_cannot_be_written(tiny_model, tmp_path):
    job = make_job(tmp_path, tiny_model)
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _make_unwritable(ro):
        pytest.skip("cannot make a folder unwritable here")
    try:
        for path in ("ro", "ro/sub"):
            line = one_line_error(runner.invoke(app, ["run", str(job), "--set", f"output.path={path}"]))
            assert f"output.path: cannot write to {ro}" in line
    finally:
        _restore(ro)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\ninput:\n  path: in.jsonl\n   id_column: id\n")
    line = one_line_error(runner.invoke(app, ["run", str(bad)]))
    assert line == f"error: {bad}:4:13: not valid YAML: mapping values are not allowed here"
    bad.write_text("model: m\noutput: {path: out, rows_per_part: [1\nprompt: x\n")
    line = one_line_error(runner.invoke(app, ["validate", str(bad)]))
    assert f"{bad}:3:7: not valid YAML" in line and "flow sequence" in line


def test_kv_cache_layout_the_attention_backend_cannot_read(tiny_model, tmp_path):
    """engine.kv_cache_layout head on the CPU's torch attention backend (it reads token only), and
    a layout that does not exist: one line naming the field, exit 2."""
    job = make_job(tmp_path, tiny_model, engine={"kv_cache_layout": "head"})
    line = one_line_error(runner.invoke(app, ["run", str(job)]))
    assert "kv_cache_layout 'head'" in line and "torch attention backend" in line
    job = make_job(tmp_path, tiny_model, engine={"kv_cache_layout": "rows"})
    res = runner.invoke(app, ["run", str(job)])  # refused with the job file's other field errors
    assert res.exit_code == 2 and "kv_cache_layout must be auto, token or head, not 'rows'" in res.stderr, res.output
    assert "Traceback" not in res.output
