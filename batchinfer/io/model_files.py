"""What of a model folder goes into the job fingerprint: configs, tokenizer files, weight sizes/mtimes.

Why sizes and mtimes rather than hashing weights: hashing tens of GB on every start would cost
minutes; a changed checkpoint changes its size or mtime (or, for sharded ones, its index).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json")


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_components(model_dir: Path) -> dict[str, Any]:
    """A JSON-able description of the model folder that changes when the model's outputs could."""
    out: dict[str, Any] = {}
    for name in CONFIG_FILES + TOKENIZER_FILES:
        p = model_dir / name
        if p.is_file():
            out[name] = file_sha256(p)
    weights = sorted(model_dir.glob("*.safetensors"))
    out["weights"] = [[w.name, w.stat().st_size, int(w.stat().st_mtime_ns)] for w in weights]
    return out


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def read_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())
