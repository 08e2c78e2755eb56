"""Reading a GGUF file (llama.cpp's single-file model format): metadata, tensor table, tensor values.

Layout (little-endian, versions 2 and 3): the magic `GGUF`, a uint32 version, uint64 tensor and
metadata counts; the metadata as (key, type, value) records; one record per tensor (name, dims with
the fastest-varying first, ggml type, offset); then, from the next multiple of `general.alignment`
(32 by default), the tensor data. Strings are a uint64 length and UTF-8 bytes.

The header is parsed here with `struct` over a memory map (the `gguf` package's reader builds a
numpy view per array element and takes ~4 s on a 49k-token vocabulary; this takes ~0.1 s); the
`gguf` package is used for the block formats (`gguf.quants.dequantize`). Anything wrong with the
file (not a GGUF, an unknown type, cut short) is a GGUFError naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types -> struct format (8 = string, 9 = array are read separately)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a readable GGUF, or holds something this converter does not support."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value; arrays of strings are lists of str, numeric
    arrays numpy arrays), `tensors` (name -> TensorInfo), `tensor(name)` -> float32 numpy array."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        size = self.path.stat().st_size
        if size < 24:
            self._file.close()
            raise GGUFError(f"{self.path} is not a GGUF file (only {size} bytes)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = size
        self._pos = 0
        try:
            self._parse()
        except GGUFError:
            self.close()
            raise
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as exc:
            self.close()
            raise GGUFError(f"{self.path} is not a valid GGUF file: {exc}") from None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:  # an array still views the map: it is released with that array
                pass
            self._map = None
        self._file.close()

    # --- header ------------------------------------------------------------------------------

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > self._size:
            raise GGUFError(
                f"{self.path} is truncated or corrupt: reading {what} at byte {self._pos} needs {n} bytes, "
                f"the file has {self._size}"
            )

    def _unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self._need(n, what)
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += n
        return value

    def _string(self, what: str) -> str:
        n = self._unpack("<Q", what)
        self._need(n, what)
        raw = self._map[self._pos : self._pos + n]
        self._pos += n
        return raw.decode("utf-8")

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype], f"value of {key}")
        if vtype == _STRING:
            return self._string(f"value of {key}")
        if vtype == _ARRAY:
            etype = self._unpack("<I", f"array type of {key}")
            count = self._unpack("<Q", f"array length of {key}")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                self._need(count * dtype.itemsize, f"array {key}")
                arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += count * dtype.itemsize
                return arr
            if etype == _STRING:
                return self._string_array(count, key)
            if etype == _ARRAY:
                return [self._value(_ARRAY, key) for _ in range(count)]
            raise GGUFError(f"{self.path}: metadata {key!r} is an array of unknown type {etype}")
        raise GGUFError(f"{self.path}: metadata {key!r} has unknown type {vtype} (corrupt file?)")

    def _string_array(self, count: int, key: str) -> list[str]:
        out = []
        buf, pos, size = self._map, self._pos, self._size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self._pos = pos
                self._need(8, f"array {key}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                self._pos = pos
                self._need(n, f"array {key}")
            out.append(buf[pos : pos + n].decode("utf-8"))
            pos += n
        self._pos = pos
        return out

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        if self._map[:4] != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with {MAGIC!r})")
        self._pos = 4
        self.version = self._unpack("<I", "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors = self._unpack("<Q", "tensor count")
        n_kv = self._unpack("<Q", "metadata count")
        if n_tensors > self._size or n_kv > self._size:
            raise GGUFError(f"{self.path} is corrupt: it claims {n_tensors} tensors and {n_kv} metadata entries")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string("metadata key")
            vtype = self._unpack("<I", f"type of {key}")
            self.metadata[key] = self._value(vtype, key)
        raw = []
        for _ in range(n_tensors):
            name = self._string("tensor name")
            n_dims = self._unpack("<I", f"dims of {name}")
            if n_dims > 8:
                raise GGUFError(f"{self.path} is corrupt: tensor {name} has {n_dims} dimensions")
            dims = [self._unpack("<Q", f"dims of {name}") for _ in range(n_dims)]
            ggml_type = self._unpack("<I", f"type of {name}")
            offset = self._unpack("<Q", f"offset of {name}")
            raw.append((name, dims, ggml_type, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in raw:
            if ggml_type not in GGML_QUANT_SIZES:
                raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise GGUFError(f"{self.path} is corrupt: tensor {name} rows of {dims[0]} are not whole {block}-blocks")
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > self._size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {name} ends at byte {start + nbytes}, the file has {self._size}"
                )
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    # --- values ------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def type_name(self, name: str) -> str:
        from gguf.constants import GGMLQuantizationType

        t = self.tensors[name].ggml_type
        try:
            return GGMLQuantizationType(t).name
        except ValueError:
            return str(t)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor's values as a float32 array of its shape (dequantised from its block format)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1]
        row_bytes = info.shape[-1] // block * type_size
        data = data.reshape(*rows, row_bytes)
        if qtype == GGMLQuantizationType.F32:
            values = data.view(np.float32).copy()  # no view into the map: close() must not see one
        elif qtype == GGMLQuantizationType.F16:
            values = data.view(np.float16).astype(np.float32)
        elif qtype == GGMLQuantizationType.BF16:
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            try:
                values = dequantize(data, qtype)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {name} is {qtype.name}, which cannot be dequantised") from None
        return np.asarray(values, dtype=np.float32).reshape(info.shape)
