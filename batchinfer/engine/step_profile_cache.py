"""The largest step's measured memory, kept between runs on one machine.

On a GPU the runner sizes the KV cache from one profiling forward of the largest step (kv_budget.py).
That forward costs 1.0-1.1 s of every start of a 7B shape on the H200 (BENCHMARKS.md), yet what it
measures depends only on the model's shapes, the engine settings that build that step, the GPU and
the software. So its result is kept in the cache folder (cache_dir.py) under a key of all of those,
and a repeat run (cron, a retry, `bench job`'s measured run after its warm-up) reads it back instead.

Two numbers are kept: the allocator's peak over the step (the activation reserve) and the device
memory the profiling forward left in use after it (CUDA modules it loaded, library workspaces), which
a run that skips the forward must still leave free for its first step. A process that had run a
forward before (a second engine in one process) measures less of the latter; the KV budget's
fraction (0.9 by default) leaves more than that room either way.

The key includes a hash of the engine's own sources (models, attention, kernels, the runner and the
sampler), so a changed kernel profiles again; EngineConfig.step_profile_cache False always profiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from batchinfer.cache_dir import cache_dir
from batchinfer.engine.config import EngineConfig

log = logging.getLogger(__name__)

VERSION = 1  # of the file's layout and of what the profile measures
PACKAGE = Path(__file__).resolve().parent.parent
SOURCES = ("models", "attention", "kernels", "engine/model_runner.py", "engine/sampler.py", "engine/kv_cache.py")

# EngineConfig fields that cannot change the largest step's memory (scheduling, host work, sampling
# seeds, the KV budget's own shares): everything else is in the key, so a new field is keyed by default.
NOT_KEYED = frozenset({
    "model", "device", "kv_cache_memory_fraction", "kv_cache_gib", "num_kv_blocks", "enable_prefix_sharing",
    "overlap", "grammar_backend", "grammar_threads", "grammar_share_masks", "grammar_mask_cache_mb", "seed",
    "torch_threads", "prefill_policy", "slack_tolerance", "slack_max_wait_steps", "slack_max_idle_slots",
    "step_profile_cache",
})


@dataclass(frozen=True)
class StepProfile:
    activation_peak_bytes: int  # the allocator's peak over the largest step, above what was allocated before it
    retained_bytes: int  # free device memory the profiling forward used up for good (modules, workspaces)


@lru_cache(maxsize=1)
def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        path = PACKAGE / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(PACKAGE)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def profile_key(config: EngineConfig, model_config: dict[str, Any], max_model_len: int, device: dict[str, Any],
                software: dict[str, str]) -> str:
    """The key of a profile: what builds the largest step (the model's config.json as loaded, the
    keyed engine settings, the effective max_model_len), the GPU and the software."""
    settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in NOT_KEYED}
    settings["max_model_len"] = max_model_len
    record = {
        "version": VERSION, "model": model_config, "engine": settings, "device": device, "software": software,
        "sources": _sources_digest(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=repr).encode()).hexdigest()[:40]


def path_for(key: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / "step-profiles" / f"{key}.json"


def read(path: Path) -> StepProfile | None:
    """The profile stored at path; None if there is none or it cannot be read (it is then measured again)."""
    try:
        data = json.loads(path.read_text())
        profile = StepProfile(**{f.name: int(data[f.name]) for f in fields(StepProfile)})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if profile.activation_peak_bytes <= 0 or profile.retained_bytes < 0:
        return None
    return profile


def write(path: Path, profile: StepProfile) -> None:
    """Store a profile (atomically: a reader sees the old file or the new one). A folder that cannot be
    written only costs the next run its profiling forward, so errors are logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(profile)))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("step profile not stored at %s: %s", path, e)
