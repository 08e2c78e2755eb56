"""`bench matrix` on the CPU: two small model folders x one workload, one engine per shape, the table."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from batchinfer.bench.matrix import STEP_KINDS, format_markdown, run_matrix, shape_summary
from batchinfer.bench.shapes import MATRIX, SHAPES, TOKENIZER_FIT
from batchinfer.cli import app


def test_matrix_covers_the_issue_s_shape_ranges():
    s = [shape_summary(n) for n in MATRIX]
    assert {x["group"] for x in s} >= {1, 2, 3, 4, 6, 7, 8}
    assert {x["head_dim"] for x in s} == {64, 128}
    assert min(x["hidden"] for x in s) == 576 and max(x["hidden"] for x in s) == 8192
    assert {x["tied"] for x in s} == {True, False}
    assert {x["kv_heads"] for x in s} >= {2, 3, 4, 8}
    for n in MATRIX:  # every shape's vocabulary embeds the tokenizer it gets
        c = SHAPES[n]
        fit = TOKENIZER_FIT.get(n)
        ids = 151851 if fit is None else fit["num_ranks"] + len(fit["specials"])
        assert ids <= c["vocab_size"], n
        if fit is not None:  # the shape's EOS is the cut tokenizer's <|im_end|> (what a text job stops on)
            assert fit["num_ranks"] + fit["specials"].index("<|im_end|>") == c["eos_token_id"], n
        assert c["num_attention_heads"] % c["num_key_value_heads"] == 0


def test_run_matrix_two_shapes(model_factory, tmp_path):
    a = model_factory("qwen3")
    b = model_factory("llama", num_key_value_heads=1)
    lines = []
    r = run_matrix([str(a), str(b)], ["nano256"], scale=0.02, count_scale=0.01, cache_dir=tmp_path, log=lines.append)
    assert [row["shape"] for row in r["rows"]] == [str(a), str(b)]
    for row in r["rows"]:
        assert row["errors"] == 0 and row["requests"] == 2 and row["output_tokens"] > 0
        assert 0 < row["fraction_of_roofline"]
        assert set(row["step_kinds"]) <= set(STEP_KINDS) and "prefill/mixed" in row["step_kinds"]
        assert abs(sum(k["share"] for k in row["step_kinds"].values()) - 1) < 1e-6
    assert r["rows"][1]["kv_heads"] == 1
    assert len(lines) == 2 and "% of the roofline floor" in lines[0]
    table = format_markdown(r).splitlines()
    assert table[2].startswith("| shape |") and len(table) == 4 + 2
    assert "prefill/mixed" in table[2] and table[4].count("|") == table[2].count("|")


def test_cli_matrix_writes_json_and_markdown(tiny_model, tmp_path):
    js, md = tmp_path / "m.json", tmp_path / "m.md"
    res = CliRunner().invoke(app, ["bench", "matrix", "--shapes", str(tiny_model), "--workloads", "nano256",
                                   "--scale", "0.02", "--count-scale", "0.01", "--json", str(js), "--markdown", str(md)])
    assert res.exit_code == 0, res.output
    assert json.loads(js.read_text())["rows"][0]["workload"] == "nano256"
    assert md.read_text().count("\n| ") == 2  # header and one row
    bad = CliRunner().invoke(app, ["bench", "matrix", "--shapes", "no-such-shape"])
    assert bad.exit_code == 2 and "--shapes" in bad.output
