"""Where files live: the local disk, or a remote store through `pyarrow.fs` (s3://, gs://, hdfs://)
or fsspec (any other scheme an installed fsspec package serves, e.g. hf://, memory://).

Everything the job reads and writes goes through a `Location` (a store and a path in it), so the
readers, the writer, the manifest and the run records never ask which store they have. A path
without a scheme (or `file://`) is the local disk; a URI is never turned into a local path.

What the commit protocol needs, and what each store gives:
  local disk     `write_atomic` writes a temp file, fsyncs it, renames it over the final name
                 (atomic) and fsyncs the folder: readers see the old file or the new one, never half.
  object stores  (S3, GCS, and fsspec stores that upload on close) have no atomic rename (a move is
                 copy + delete), but an object becomes visible only when its upload completes, whole,
                 and a PUT over an existing object replaces it at once. So `write_atomic` uploads a
                 complete buffer under the final name in one stream: a killed upload leaves nothing
                 visible (an unfinished multipart upload is invisible; a bucket lifecycle rule
                 cleans them up). Listings and reads after writes are strongly consistent on S3 and GCS.
  locks          local: an flock on a file (released by the kernel when the process dies);
                 remote: a lease object refreshed every LEASE_REFRESH_S by the holder. A lease
                 older than LEASE_STALE_S, or one held by a dead process on this host, is taken
                 over. Object stores have no compare-and-swap here, so two runs started within the
                 same second could both take it: the lease guards against mistakes, not races.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

log = logging.getLogger(__name__)

URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
ARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs")  # served by pyarrow.fs itself
GLOB_CHARS = "*?["
LEASE_REFRESH_S = 30.0
LEASE_STALE_S = 120.0
SPOOL_BYTES = 64 * 2**20  # remote writes are buffered in memory up to this, then in a local temp file


class StoreError(ValueError):
    """A path no store can serve (unknown scheme, a bucket without a folder, missing fsspec package)."""


class LockedError(ValueError):
    """Another run holds the lock of an output folder."""


def is_uri(text: str | os.PathLike) -> bool:
    """True for `scheme://...` (including file://); False for plain local paths (also Windows `C:\\`)."""
    return isinstance(text, str) and bool(URI_RE.match(text))


def has_glob(text: str) -> bool:
    return any(ch in text for ch in GLOB_CHARS)


# ---- the stores ------------------------------------------------------------------------------------


class LocalStore:
    """The local disk (os calls, fsync and rename for atomic writes, flock for the lock)."""

    kind = "local"
    atomic_rename = True

    def uri(self, path: str) -> str:
        return path

    def join(self, path: str, name: str) -> str:
        return os.path.join(path, name)

    def parent(self, path: str) -> str:
        return os.path.dirname(path.rstrip(os.sep)) or path

    def name(self, path: str) -> str:
        return os.path.basename(path.rstrip(os.sep))

    def kind_of(self, path: str) -> str | None:
        """"file", "dir" or None (missing)."""
        if os.path.isdir(path):
            return "dir"
        return "file" if os.path.exists(path) else None

    def files(self, path: str, recursive: bool = False, max_depth: int | None = None) -> list[str]:
        """The files below a folder (sorted; recursive: every depth, or up to max_depth levels)."""
        if not os.path.isdir(path):
            return []
        if not recursive:
            return sorted(e.path for e in os.scandir(path) if e.is_file())
        out = []
        base = path.rstrip(os.sep).count(os.sep)
        for root, dirs, names in os.walk(path):
            if max_depth is not None and root.rstrip(os.sep).count(os.sep) - base >= max_depth - 1:
                dirs[:] = []
            dirs.sort()
            out.extend(os.path.join(root, n) for n in names)
        return sorted(out)

    def open_input_file(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def mtime(self, path: str) -> float:
        return os.stat(path).st_mtime

    def open_input_stream(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    @contextlib.contextmanager
    def open_atomic(self, path: str, tmp_dir: str | None = None) -> Iterator[IO[bytes]]:
        """A file that appears at `path` only when the block ends without an exception (whole, fsynced).

        The temp file goes in `tmp_dir` (default: beside `path`); a rename across folders that are not on
        one file system falls back to a temp file beside `path`.
        """
        folder = os.path.dirname(path) or "."
        tdir = tmp_dir or folder
        os.makedirs(tdir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=tdir)
        try:
            with os.fdopen(fd, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.replace(tmp, path)
            except OSError as e:
                if tdir == folder or e.errno != 18:  # 18: EXDEV, a rename across file systems
                    raise
                with open(tmp, "rb") as src, self.open_atomic(path) as dst:
                    shutil.copyfileobj(src, dst)
                os.unlink(tmp)
            fsync_dir(folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def delete_tree(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def move(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        fsync_dir(os.path.dirname(dst) or ".")

    def lock(self, path: str, what: str) -> Any:
        import fcntl

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fh = open(path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise LockedError(f"another batchinfer run is writing to {what}; wait for it to finish") from None
        return fh


class ArrowStore:
    """A pyarrow.fs FileSystem: S3, GCS, HDFS, or an fsspec file system wrapped by pyarrow."""

    kind = "remote"
    atomic_rename = False

    def __init__(self, fs: Any, prefix: str) -> None:
        self.fs = fs
        self.prefix = prefix  # what makes a URI of a path in fs: "s3://", "hdfs://host:8020", "memory://"

    def uri(self, path: str) -> str:
        return self.prefix + path

    def join(self, path: str, name: str) -> str:
        return f"{path.rstrip('/')}/{name}"

    def parent(self, path: str) -> str:
        p = path.rstrip("/")
        return p.rsplit("/", 1)[0] if "/" in p else p

    def name(self, path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    def kind_of(self, path: str) -> str | None:
        from pyarrow import fs as pafs

        t = self.fs.get_file_info(path.rstrip("/")).type
        return {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}.get(t)

    def files(self, path: str, recursive: bool = False, max_depth: int | None = None) -> list[str]:
        from pyarrow import fs as pafs

        base = path.rstrip("/")
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = [i.path for i in infos if i.type == pafs.FileType.File]
        if max_depth is not None:
            out = [p for p in out if p[len(base) + 1 :].count("/") < max_depth]
        return sorted(out)

    def open_input_file(self, path: str) -> Any:
        return self.fs.open_input_file(path)

    def mtime(self, path: str) -> float:
        info = self.fs.get_file_info(path)
        if info.mtime is None:
            raise FileNotFoundError(self.uri(path)) if info.type.name == "NotFound" else OSError(f"{self.uri(path)}: no modification time")
        return info.mtime.timestamp()

    def open_input_stream(self, path: str) -> Any:
        return self.fs.open_input_stream(path, compression=None)

    @contextlib.contextmanager
    def open_atomic(self, path: str, tmp_dir: str | None = None) -> Iterator[IO[bytes]]:
        """Bytes written in the block are uploaded under `path` in one stream when it ends without an
        exception; on an exception nothing is uploaded (see the module docstring)."""
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as buf:
            yield buf  # type: ignore[misc]
            buf.seek(0)
            with self.fs.open_output_stream(path) as out:
                shutil.copyfileobj(buf, out, 8 * 2**20)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path, compression=None) as fh:
            return fh.read()

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(path)

    def delete_tree(self, path: str) -> None:
        for f in self.files(path, recursive=True):
            self.delete(f)
        with contextlib.suppress(OSError):
            if self.kind_of(path) == "dir":
                self.fs.delete_dir(path.rstrip("/"))

    def makedirs(self, path: str) -> None:
        """Object stores need no folders (making one would leave a marker object readers may list)."""
        if self.fs.type_name in ("s3", "gcs"):
            return
        with contextlib.suppress(OSError):
            self.fs.create_dir(path.rstrip("/"), recursive=True)

    def move(self, src: str, dst: str) -> None:
        self.fs.move(src, dst)

    def lock(self, path: str, what: str) -> "Lease":
        return Lease.take(self, path, what)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Lease:
    """A lock on a remote store: an object naming its holder, refreshed by a thread (see the module docstring)."""

    def __init__(self, store: ArrowStore, path: str, token: str) -> None:
        self.store, self.path, self.token = store, path, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="batchinfer-lease", daemon=True)

    @classmethod
    def take(cls, store: ArrowStore, path: str, what: str) -> "Lease":
        held = _read_lease(store, path)
        if held is not None and not _stale(held):
            age = time.time() - float(held.get("heartbeat", 0))
            raise LockedError(
                f"another batchinfer run (host {held.get('host')}, pid {held.get('pid')}, seen {age:.0f}s ago) is "
                f"writing to {what}; wait for it to finish (a dead run's lock expires {LEASE_STALE_S:.0f}s after "
                f"its last heartbeat, or delete {store.uri(path)})"
            )
        lease = cls(store, path, f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}")
        lease._write()
        mine = _read_lease(store, path)
        if mine is None or mine.get("token") != lease.token:
            raise LockedError(f"another batchinfer run took the lock of {what} at the same moment; wait for it to finish")
        lease._thread.start()
        return lease

    def _write(self) -> None:
        body = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        with self.store.open_atomic(self.path) as fh:
            fh.write(json.dumps(body).encode())

    def _refresh(self) -> None:
        while not self._stop.wait(LEASE_REFRESH_S):
            try:
                held = _read_lease(self.store, self.path)
                if held is not None and held.get("token") != self.token:
                    log.error("the lock %s was taken over by %s; this run should stop", self.store.uri(self.path), held.get("host"))
                    return
                self._write()
            except Exception as e:  # a missed heartbeat is retried; the lease goes stale only after several
                log.warning("could not refresh the lock %s: %s", self.store.uri(self.path), e)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            held = _read_lease(self.store, self.path)
            if held is not None and held.get("token") == self.token:
                self.store.delete(self.path)
        except Exception as e:
            log.warning("could not release the lock %s: %s", self.store.uri(self.path), e)


def _read_lease(store: ArrowStore, path: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.read_bytes(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treat as stale


def _stale(held: dict[str, Any]) -> bool:
    if time.time() - float(held.get("heartbeat", 0) or 0) > LEASE_STALE_S:
        return True
    if held.get("host") == socket.gethostname():
        try:
            os.kill(int(held.get("pid", -1)), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            return False
    return False


# ---- locations -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Location:
    """A path in a store: what the job's readers and writers pass around instead of a local Path."""

    store: Any  # LocalStore | ArrowStore
    path: str
    text: str | None = None  # how the user wrote it (kept for messages and for other processes)

    def __str__(self) -> str:
        return self.text or self.store.uri(self.path)

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def __truediv__(self, name: str) -> "Location":
        return Location(self.store, self.store.join(self.path, name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and type(other.store) is type(self.store) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    @property
    def uri(self) -> str:
        """The full path or URI (never the user's text: children and parents are built from it)."""
        return self.store.uri(self.path)

    @property
    def name(self) -> str:
        return self.store.name(self.path)

    @property
    def parent(self) -> "Location":
        return Location(self.store, self.store.parent(self.path))

    @property
    def atomic_rename(self) -> bool:
        return self.store.atomic_rename

    def with_name(self, name: str) -> "Location":
        return self.parent / name

    def is_within(self, other: "Location") -> bool:
        """True when this location is `other` or below it (same store)."""
        if type(other.store) is not type(self.store):
            return False
        a, b = self.uri.rstrip("/"), other.uri.rstrip("/")
        return a == b or a.startswith(b + "/")

    def exists(self) -> bool:
        return self.store.kind_of(self.path) is not None

    def is_dir(self) -> bool:
        return self.store.kind_of(self.path) == "dir"

    def is_file(self) -> bool:
        return self.store.kind_of(self.path) == "file"

    def files(self, recursive: bool = False, max_depth: int | None = None) -> list["Location"]:
        return [Location(self.store, p) for p in self.store.files(self.path, recursive, max_depth)]

    def names(self) -> list[str]:
        """Names of the files directly in this folder (sorted; [] when it does not exist)."""
        return [self.store.name(p) for p in self.store.files(self.path)]

    def relative_parts(self, root: "Location") -> list[str]:
        """The path components of this location below `root` (which it must be within)."""
        rest = self.uri[len(root.uri.rstrip("/")) :].strip("/")
        return [p for p in rest.split("/") if p] if rest else []

    def open_input_file(self) -> Any:
        return self.store.open_input_file(self.path)

    def open_input_stream(self) -> Any:
        return self.store.open_input_stream(self.path)

    def mtime(self) -> float:
        """Modification time (seconds since the epoch)."""
        return self.store.mtime(self.path)

    def open_atomic(self, tmp_dir: "Location | None" = None) -> Any:
        return self.store.open_atomic(self.path, tmp_dir.path if tmp_dir is not None else None)

    @contextlib.contextmanager
    def open_atomic_text(self, tmp_dir: "Location | None" = None) -> Iterator[io.TextIOWrapper]:
        """open_atomic for UTF-8 text."""
        with self.open_atomic(tmp_dir) as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", newline="")
            try:
                yield text
                text.flush()
            finally:
                text.detach()

    def count_lines(self) -> int:
        """Lines of a text file (0 when it does not exist)."""
        try:
            return self.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def write_atomic(self, data: bytes, tmp_dir: "Location | None" = None) -> None:
        with self.open_atomic(tmp_dir) as fh:
            fh.write(data)

    def write_text(self, text: str, tmp_dir: "Location | None" = None) -> None:
        self.write_atomic(text.encode("utf-8"), tmp_dir)

    def read_bytes(self) -> bytes:
        return self.store.read_bytes(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def delete(self) -> None:
        self.store.delete(self.path)

    def delete_tree(self) -> None:
        self.store.delete_tree(self.path)

    def makedirs(self) -> None:
        self.store.makedirs(self.path)

    def move_to(self, dst: "Location") -> None:
        self.store.move(self.path, dst.path)

    def lock(self, what: str) -> Any:
        return self.store.lock(self.path, what)

    def local_path(self) -> Path | None:
        """A local Path for the local disk, None for a remote store (callers that need a real file, e.g.
        a profiler or matplotlib, then use a temp file)."""
        return Path(self.path) if isinstance(self.store, LocalStore) else None


def location(target: "str | os.PathLike[str] | Location") -> Location:
    """The Location of a local path or a URI (s3://, gs://, hdfs://, file://, or any fsspec scheme)."""
    if isinstance(target, Location):
        return target
    text = os.fspath(target)
    m = URI_RE.match(text)
    if m is None:
        return Location(LOCAL, os.path.abspath(text), text)
    scheme = m.group(1).lower()
    if scheme == "file":
        from urllib.parse import unquote, urlparse

        return Location(LOCAL, unquote(urlparse(text).path), text)
    if scheme in ARROW_SCHEMES:
        from pyarrow import fs as pafs

        try:
            fs, path = pafs.FileSystem.from_uri(text)
        except (ValueError, OSError) as e:
            raise StoreError(f"{text}: {e}") from None
        bare = text.split("?", 1)[0].rstrip("/")
        prefix = bare[: len(bare) - len(path.rstrip("/"))] if bare.endswith(path.rstrip("/")) else f"{scheme}://"
        return Location(ArrowStore(fs, prefix), path.rstrip("/") or path, text)
    return _fsspec_location(text, scheme)


def _fsspec_location(text: str, scheme: str) -> Location:
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem
    except ImportError:
        raise StoreError(f"{text}: the {scheme}:// scheme needs fsspec (pip install fsspec and its {scheme} package)") from None
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as e:
        raise StoreError(f"{text}: no file system for {scheme}:// ({e})") from None
    full = fs.unstrip_protocol(path)
    prefix = full[: len(full) - len(path)] if full.endswith(path) else f"{scheme}://"
    return Location(ArrowStore(PyFileSystem(FSSpecHandler(fs)), prefix), path, text)


LOCAL = LocalStore()


# ---- input listing ---------------------------------------------------------------------------------


def split_glob(pattern: str) -> tuple[str, list[str]]:
    """(the folder to list: the part before the first component with a wildcard, the components from there)."""
    m = URI_RE.match(pattern)
    head = pattern[: m.end()] if m else ""
    parts = pattern[len(head) :].split("/")
    n = next((i for i, p in enumerate(parts) if has_glob(p)), len(parts))
    root = "/".join(parts[:n])
    if not root and pattern[len(head) :].startswith("/"):
        root = "/"
    return (head + root if (head or root) else "."), [p for p in parts[n:] if p]


def match_glob(pattern_parts: list[str], parts: list[str]) -> bool:
    """Does a path (its components below the glob's root) match the pattern's components?

    Like Python's glob with recursive=True: `**` matches any number of folders, `*`, `?` and `[...]`
    match within one component, and a wildcard never matches a name that starts with a dot.
    """
    if not pattern_parts:
        return not parts
    head, rest = pattern_parts[0], pattern_parts[1:]
    if head == "**":
        for i in range(len(parts) + 1):
            if i and parts[i - 1].startswith("."):
                break
            if match_glob(rest, parts[i:]):
                return True
        return False
    if not parts:
        return False
    name = parts[0]
    if name.startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and match_glob(rest, parts[1:])


def expand_glob(pattern: str) -> tuple[Location, list[Location]]:
    """(root, matching files) of a glob on any store (files only, sorted)."""
    root_text, rest = split_glob(pattern)
    root = location(root_text)
    max_depth = None if "**" in rest else len(rest)
    found = [f for f in root.files(recursive=True, max_depth=max_depth) if match_glob(rest, f.relative_parts(root))]
    return root, found


def text_stream(raw: Any, gz: bool) -> io.TextIOBase:
    """Text lines (UTF-8, bad bytes replaced) of a binary stream, gunzipped when gz."""
    import gzip

    if gz:
        raw = gzip.GzipFile(fileobj=raw, mode="rb")
    elif not isinstance(raw, io.BufferedIOBase):
        raw = io.BufferedReader(raw) if isinstance(raw, io.RawIOBase) else raw
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


__all__ = [
    "ArrowStore", "GLOB_CHARS", "LOCAL", "Lease", "LocalStore", "Location", "LockedError", "StoreError",
    "expand_glob", "fsync_dir", "split_glob", "has_glob", "is_uri", "location", "match_glob", "text_stream",
]
