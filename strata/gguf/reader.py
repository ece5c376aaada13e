"""GGUF files as llama.cpp writes them: the metadata, the tensor directory, and each tensor's bytes memory-mapped,
across the parts of a split model (`NAME-00001-of-0000N.gguf`)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from strata.errors import ConfigError
from strata.gguf.types import tensor_nbytes

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata value types with a fixed width: (struct format, numpy dtype).
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
            5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
            11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: its ggml type and shape in torch order (outermost first, e.g. [rows, cols]),
    and where its bytes lie."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    part: int  # index of the split file holding it
    offset: int  # from the start of that file
    nbytes: int


class _Cursor:
    """Reads little-endian values from a file object, with a clear error when the file ends early."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ConfigError(f"{self.path}: the GGUF file ends early (truncated download?)", param="model")
        return data

    def scalar(self, kind: int) -> Any:
        fmt, _ = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALARS:  # one read for a whole array of numbers (token types, scores)
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ConfigError(f"{self.path}: unknown GGUF metadata value type {kind}", param="model")
        return self.scalar(kind)


def _read_header(path: str, part: int) -> tuple[dict[str, Any], list[TensorEntry]]:
    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        if cur.take(4) != _MAGIC:
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic at its start)", param="model")
        version = cur.u32()
        if version not in _VERSIONS:
            raise ConfigError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)", param="model")
        num_tensors, num_values = cur.u64(), cur.u64()
        metadata = {}
        for _ in range(num_values):
            key = cur.string()
            metadata[key] = cur.value(cur.u32())
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = [cur.u64() for _ in range(cur.u32())]
            infos.append((name, cur.u32(), tuple(reversed(dims)), cur.u64()))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-f.tell() // alignment) * alignment
        size = f.seek(0, 2)
    entries = []
    for name, ggml_type, shape, offset in infos:
        nbytes = tensor_nbytes(name, ggml_type, shape)
        if data_start + offset + nbytes > size:
            raise ConfigError(f"{path}: tensor {name} lies past the end of the file (truncated download?)",
                              param="model")
        entries.append(TensorEntry(name, ggml_type, shape, part, data_start + offset, nbytes))
    return metadata, entries


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata of one GGUF file (a split model's first part carries all of it), tensors not listed."""
    return _read_header(str(path), 0)[0]


class GGUFModel:
    """The metadata of a GGUF model (its first part's, which carries all of it) and the tensors of all its parts.
    Tensor bytes are memory-mapped: `raw(name)` is a read-only uint8 view, nothing is read until used."""

    def __init__(self, paths: list[str] | tuple[str, ...]) -> None:
        self.paths = [str(p) for p in paths]
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorEntry] = {}
        for part, path in enumerate(self.paths):
            metadata, entries = _read_header(path, part)
            if part == 0:
                self.metadata = metadata
            for entry in entries:
                if entry.name in self.tensors:
                    raise ConfigError(f"tensor {entry.name} appears twice in {', '.join(self.paths)}", param="model")
                self.tensors[entry.name] = entry
        expected = self.metadata.get("split.count", 1)
        if expected != len(self.paths):
            raise ConfigError(f"{self.paths[0]} is part of a model split into {expected} files, but "
                              f"{len(self.paths)} were given", param="model")
        self._maps: dict[int, mmap.mmap] = {}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; keys starting with "." are the architecture's own (".block_count")."""
        if key.startswith("."):
            key = self.architecture + key
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows, bytes per row] (1-D tensors: [bytes])."""
        entry = self.tensors[name]
        if entry.part not in self._maps:
            with open(self.paths[entry.part], "rb") as f:
                self._maps[entry.part] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(self._maps[entry.part], dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
        return data.reshape(rows, -1) if len(entry.shape) > 1 else data

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # maps are per process
