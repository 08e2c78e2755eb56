"""engine/step_profile_cache.py: the KV sizing's profile kept between starts (its use by the runner on a
GPU is in test_gpu_engine.py)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from batchinfer.engine import EngineConfig
from batchinfer.engine import step_profile_cache as spc

MODEL = {"num_layers": 28, "hidden_size": 1024, "dtype": "torch.bfloat16"}
DEVICE = {"name": "NVIDIA H200", "total_memory": 150_000_000_000, "capability": [9, 0]}
SOFTWARE = {"torch": "2.11.0", "cuda": "12.8", "triton": "3.6.0"}


def _key(config: EngineConfig, model=MODEL, max_len: int = 4096, device=DEVICE, software=SOFTWARE) -> str:
    return spc.profile_key(config, model, max_len, device, software)


def test_the_key_follows_what_builds_the_largest_step():
    base = EngineConfig(model="/models/a")
    key = _key(base)
    assert key == _key(EngineConfig(model="/models/a"))
    # where the model lives, and settings that do not shape the step, leave the key alone
    for same in (
        replace(base, model="/elsewhere/a"), replace(base, kv_cache_memory_fraction=0.5), replace(base, seed=7),
        replace(base, grammar_threads=3), replace(base, prefill_policy="slack"), replace(base, step_profile_cache=False),
    ):
        assert _key(same) == key
    # the step's size and kind, the model, the GPU, the software each change it
    for other in (
        replace(base, max_num_batched_tokens=4096), replace(base, max_num_seqs=128), replace(base, dtype="float16"),
        replace(base, kv_cache_dtype="fp8_e4m3"), replace(base, quantization="fp8"), replace(base, cuda_graph_max_tokens=0),
        replace(base, attention_backend="triton-balanced"), replace(base, block_size=32),
    ):
        assert _key(other) != key, other
    assert _key(base, model={**MODEL, "hidden_size": 2048}) != key
    assert _key(base, max_len=8192) != key
    assert _key(base, device={**DEVICE, "name": "NVIDIA H100 80GB HBM3"}) != key
    assert _key(base, software={**SOFTWARE, "triton": "3.5.0"}) != key


def test_every_engine_setting_is_keyed_or_named_as_not_shaping_the_step():
    """A new EngineConfig field is in the key unless NOT_KEYED names it: this keeps that list honest."""
    names = {f.name for f in fields(EngineConfig)}
    assert spc.NOT_KEYED <= names, spc.NOT_KEYED - names


def test_the_key_follows_the_engine_sources(monkeypatch, tmp_path):
    """A changed kernel or model file profiles again."""
    pkg = tmp_path / "pkg"
    for name in spc.SOURCES:
        f = pkg / name / "x.py" if "." not in name else pkg / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("a = 1\n")
    monkeypatch.setattr(spc, "PACKAGE", pkg)
    spc._sources_digest.cache_clear()
    try:
        before = _key(EngineConfig(model="m"))
        (pkg / "kernels" / "x.py").write_text("a = 2\n")
        spc._sources_digest.cache_clear()
        assert _key(EngineConfig(model="m")) != before
    finally:
        spc._sources_digest.cache_clear()


def test_a_profile_round_trips_and_a_bad_file_reads_as_none(tmp_path):
    path = spc.path_for("k" * 40, tmp_path)
    assert spc.read(path) is None  # none yet
    profile = spc.StepProfile(activation_peak_bytes=3 << 30, retained_bytes=600 << 20)
    spc.write(path, profile)
    assert spc.read(path) == profile
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    for text in ("", "{", '{"activation_peak_bytes": 5}', '{"activation_peak_bytes": 0, "retained_bytes": 0}',
                 '{"activation_peak_bytes": "x", "retained_bytes": 1}', "[1, 2]"):
        path.write_text(text)
        assert spc.read(path) is None, text


def test_a_folder_that_cannot_be_written_costs_only_the_next_profile(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = spc.path_for("k" * 40, blocker)  # its folder would be under a file
    spc.write(path, spc.StepProfile(1, 0))  # logged, not raised
    assert spc.read(path) is None


@pytest.mark.parametrize("env", ["BATCHINFER_CACHE", "XDG_CACHE_HOME"])
def test_profiles_live_in_the_cache_folder(monkeypatch, tmp_path, env):
    monkeypatch.delenv("BATCHINFER_CACHE", raising=False)
    monkeypatch.setenv(env, str(tmp_path))
    path = spc.path_for("abc")
    assert path.parent.name == "step-profiles" and tmp_path in path.parents
