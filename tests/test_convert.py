"""convert-gguf on small GGUF files written as llama.cpp lays them out (tests/gguf_writer.py):
the same weights and tokenizer as transformers' own GGUF loader, close to the original weights,
loadable and runnable by our engine; bad files are one clear error (exit 2)."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from batchinfer.cli import app
from batchinfer.convert.gguf_file import GGUFError, GGUFFile
from batchinfer.convert.gguf_to_hf import convert_gguf, unpermute_rows
from gguf_writer import permute_rows, write_gguf

CASES = {  # family -> demo-model overrides (qwen3: transformers' GGUF reader ignores attention.key_length and
    "llama": {},  # takes Qwen3Config's default head_dim, 128, which the real Qwen3 dense models have)
    "qwen2": {},
    "qwen3": {"head_dim": 128},
}
TEXTS = ["the invoice total 1234 café 😀", "<|im_start|>user\nhi there<|im_end|>\n", "  two  spaces\n\n\ttab", "x2y3 don't"]


@pytest.fixture(scope="module")
def gguf_files(model_factory, tmp_path_factory):
    """family -> (demo model folder, GGUF file written from it)."""
    out = {}
    for family, overrides in CASES.items():
        model = model_factory(family, **overrides)
        folder = tmp_path_factory.mktemp(f"gguf-{family}")
        out[family] = (model, write_gguf(model, folder / "model.gguf", family))
    return out


def _load(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_permutation_round_trip():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rows(w, 4), w)


@pytest.mark.parametrize("family", list(CASES))
def test_weights_and_tokenizer_match_transformers_gguf_loader(family, gguf_files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, gguf = gguf_files[family]
    result = convert_gguf(gguf, tmp_path / "hf")
    ours = _load(tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"} or set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    # close to the weights the file was written from (a wrong q/k reordering would be far off)
    original = _load(model_dir)
    for name, tensor in ours.items():
        err = (tensor - original[name]).abs().mean().item()
        assert err <= 0.15 * original[name].abs().mean().item() + 1e-6, (name, err)
    assert result.architecture == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    tok_theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok_ours = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in TEXTS:
        assert tok_ours(text)["input_ids"] == tok_theirs(text)["input_ids"], text
    assert tok_ours.chat_template == tok_theirs.chat_template


def test_head_dim_other_than_hidden_over_heads(model_factory, tmp_path):
    """qwen3 with head_dim 32 on hidden 64 / 4 heads: read from attention.key_length."""
    model_dir = model_factory("qwen3")
    gguf = write_gguf(model_dir, tmp_path / "m.gguf", "qwen3")
    convert_gguf(gguf, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["head_dim"] == 32 and cfg["num_attention_heads"] == 4
    original, ours = _load(model_dir), _load(tmp_path / "hf")
    for name, tensor in ours.items():
        assert tensor.shape == original[name].shape, name


def test_converted_model_runs_in_the_engine_like_transformers(gguf_files, tmp_path):
    from transformers import AutoModelForCausalLM

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import Request, SamplingParams

    _, gguf = gguf_files["llama"]
    folder = tmp_path / "hf"
    convert_gguf(gguf, folder)
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64))
    prompts = [[5, 17, 99, 3], list(range(20, 45))]
    results = list(engine.generate([Request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                                    for i, p in enumerate(prompts)]))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for r in results:
        ids = torch.tensor([prompts[int(r.request_id)]])
        want = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert r.output_token_ids == want


def test_metadata_and_tensor_table(gguf_files):
    _, gguf = gguf_files["qwen2"]
    with GGUFFile(gguf) as f:
        assert f.get("general.architecture") == "qwen2"
        assert f.get("tokenizer.ggml.model") == "gpt2"
        assert isinstance(f.get("tokenizer.ggml.tokens"), list)
        assert f.type_name("blk.0.attn_q.weight") == "Q4_1"
        assert f.tensor("blk.0.attn_q.bias").dtype == np.float32


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _assert_one_line_error(r, *words):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for w in words:
        assert w in lines[0], r.output


def test_cli_convert_and_bad_files(gguf_files, tmp_path):
    _, gguf = gguf_files["llama"]
    r = _cli("convert-gguf", gguf, tmp_path / "ok")
    assert r.exit_code == 0, r.output
    assert "LlamaForCausalLM" in r.output and (tmp_path / "ok" / "model.safetensors").is_file()
    _assert_one_line_error(_cli("convert-gguf", gguf, tmp_path / "ok"), "already exists")
    data = gguf.read_bytes()
    for name, content, words in [
        ("truncated.gguf", data[: len(data) * 2 // 3], ("truncated",)),
        ("header.gguf", data[:300], ("truncated",)),
        ("garbage.gguf", b"PK\x03\x04" + bytes(200), ("not a GGUF file",)),
        ("empty.gguf", b"", ("not a GGUF file",)),
        ("version.gguf", b"GGUF" + struct.pack("<I", 9) + data[8:], ("version 9",)),
    ]:
        bad = tmp_path / name
        bad.write_bytes(content)
        _assert_one_line_error(_cli("convert-gguf", bad, tmp_path / f"out-{name}"), name)
        assert not (tmp_path / f"out-{name}").exists()
    _assert_one_line_error(_cli("convert-gguf", tmp_path / "missing.gguf", tmp_path / "x"), "cannot open")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder left


def test_unsupported_architecture_is_a_clear_error(gguf_files, tmp_path):
    _, gguf = gguf_files["llama"]
    data = bytearray(gguf.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8  # key, value type, string length
    data[at : at + 5] = b"gpt2x"
    bad = tmp_path / "arch.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="architecture 'gpt2x' is not supported"):
        convert_gguf(bad, tmp_path / "out")
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
