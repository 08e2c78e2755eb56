"""`bench grammar` on a small MaskBench sample (the CI-sized run: ~10 files, tiny tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchinfer.bench.cli import bench_app
from batchinfer.bench.grammar import list_files

MASKBENCH = Path("/work/shared/maskbench")
KEYS = {"schemas", "compiled", "passing", "valid_accepted", "valid_total", "invalid_rejected", "invalid_total",
        "compile_ms_p50", "compile_ms_p90", "mask_us_p50", "mask_us_p99"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from batchinfer.demo import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def write_doc(folder: Path, name: str, schema, tests) -> Path:
    p = folder / name
    p.write_text(json.dumps({"schema": schema, "tests": tests}))
    return p


def test_bench_counts_on_handmade_files(tmp_path, tokenizer_dir):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    write_doc(tmp_path, "a.json", schema, [{"valid": True, "data": {"n": 3}}, {"valid": False, "data": {"n": 12}},
                                           {"valid": False, "data": {"m": 1}}])
    write_doc(tmp_path, "b.json", {"type": "string", "pattern": "(a)\\1"}, [{"valid": True, "data": "aa"}])
    res = CliRunner().invoke(bench_app, ["grammar", str(tmp_path), "--backend", "llguidance", "--json",
                                         "--tokenizer", str(tokenizer_dir)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert KEYS <= set(out)
    assert (out["schemas"], out["compiled"], out["passing"]) == (2, 1, 1)
    assert (out["valid_accepted"], out["valid_total"], out["invalid_rejected"], out["invalid_total"]) == (1, 2, 2, 2)


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="MaskBench sample not present")
def test_bench_auto_on_maskbench_sample(tokenizer_dir):
    files = list_files([MASKBENCH], 10)
    assert len(files) == 10
    res = CliRunner().invoke(bench_app, ["grammar", str(MASKBENCH), "--limit", "10", "--backend", "auto", "--json",
                                         "--tokenizer", str(tokenizer_dir), "--compile-timeout", "5"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["schemas"] == 10 and out["compiled"] >= 8
    assert out["passing"] <= out["compiled"] and out["valid_accepted"] <= out["valid_total"]
    # auto: every invalid instance of a compiled schema is stopped by the grammar or the validation
    assert out["invalid_rejected"] >= out["invalid_total"] - 3
    assert out["mask_us_p99"] >= out["mask_us_p50"] > 0


def test_bench_refuses_bad_arguments(tmp_path):
    res = CliRunner().invoke(bench_app, ["grammar", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such file" in res.output
    res = CliRunner().invoke(bench_app, ["grammar", str(tmp_path), "--backend", "magic"])
    assert res.exit_code == 2
