"""The folder where batchinfer keeps what outlives a run on one machine: converted catalogue models
(convert/get_model.py) and the engine's start-up measurements (engine/step_profile_cache.py).

$BATCHINFER_CACHE, else $XDG_CACHE_HOME/batchinfer, else ~/.cache/batchinfer; read at call time.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("BATCHINFER_CACHE"):
        return Path(os.environ["BATCHINFER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchinfer"
