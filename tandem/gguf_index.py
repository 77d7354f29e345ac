"""A GGUF file's metadata and tensor table, read once and kept in the cache.

gguf-py's reader decodes every metadata field eagerly, the tokenizer's 49k tokens and merges one
numpy view at a time: 4.8 of the 5.1 seconds a load of the default model took, in every process
that loads it (each server's core, each worker), and again in the first load of every new file. So
the header is parsed here directly (the GGUF v2/v3 layout: key-value pairs, then the tensor table),
stepping over the large tokenizer arrays without decoding them (the tokenizer is built and cached
apart, tokenizer.py): only the scalar metadata and where each tensor lies are kept. They are written
to the cache the first time (keyed by the file's path, size and mtime); afterwards the file is
mapped once and each tensor is a view into it, exactly the dtype and shape gguf-py gives
(tests/test_gguf_index.py compares them).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.cache import cache_dir

FORMAT = 3  # the index's own layout (2: parsed here, not by gguf-py; 3: with the tokenizer's digest)
# Arrays decoded only where needed (the tokenizer build); the index keeps their lengths.
LARGE_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


class GgufError(ValueError):
    pass


@dataclass
class IndexedTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGML's order (innermost first), as gguf-py reports it
    data: np.ndarray  # a read-only view of the file


def _key(path: Path) -> str:
    stat = path.stat()
    ident = f"{FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


# GGUF value types: struct format of each scalar; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Unquantized ggml types whose data gguf-py views as numbers (every other type: uint8 rows of blocks).
_NUMERIC = {0: "<f4", 1: "<f2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}


class _Header:
    """Reads values off the file's bytes in order."""

    def __init__(self, raw: memoryview) -> None:
        self.raw, self.pos = raw, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def skip_string(self) -> int:
        """Steps over a string; returns where it starts."""
        n = self.scalar("Q")
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.raw):
            raise ValueError("a string runs past the end")
        return start

    def string(self) -> str:
        start = self.skip_string()
        return bytes(self.raw[start:self.pos]).decode("utf-8")

    def value(self, kind: int, decode: bool = True) -> Any:
        """The value (decode=False: stepped over; an array's length is returned)."""
        if kind == _STRING:
            return self.string() if decode else self.skip_string()
        if kind == _ARRAY:
            item, n = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                width = struct.calcsize(_SCALARS[item])
                start, self.pos = self.pos, self.pos + n * width
                if not decode:
                    return n
                return list(struct.unpack_from(f"<{n}{_SCALARS[item]}", self.raw, start))
            values = [self.value(item, decode) for _ in range(n)]
            return values if decode else n
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.scalar(_SCALARS[kind])


def _parse(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            raw = memoryview(mapped)
            try:
                return _parse_header(raw) | {"size": path.stat().st_size}
            finally:
                raw.release()
    except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise GgufError(f"{path} is not a valid GGUF file: {e}") from e


def _parse_header(raw: memoryview) -> dict[str, Any]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    h = _Header(raw)
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    h.pos = 4
    version = h.scalar("I")
    if version not in (2, 3):
        raise ValueError("only GGUF versions 2 and 3 are read")
    n_tensors, n_fields = h.scalar("Q"), h.scalar("Q")
    # The header's own fields, as gguf-py lists them among the metadata.
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_fields}
    lengths: dict[str, int] = {}
    tokenizer = hashlib.sha256()
    for _ in range(n_fields):
        key = h.string()
        kind = h.scalar("I")
        begin = h.pos
        if key in LARGE_ARRAYS:
            lengths[key] = h.value(kind, decode=False)
        else:
            meta[key] = h.value(kind)
        if key.startswith("tokenizer.") or key == "general.architecture":  # what a tokenizer is built from
            tokenizer.update(key.encode() + bytes(raw[begin:h.pos]))
    table = []
    for _ in range(n_tensors):
        name = h.string()
        dims = [h.scalar("Q") for _ in range(h.scalar("I"))]
        table.append((name, dims, h.scalar("I"), h.scalar("Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-h.pos // align) * align
    tensors = []
    for name, dims, kind, offset in table:
        numpy_shape = list(reversed(dims))
        dtype = _NUMERIC.get(kind)
        if dtype is None:  # rows of blocks, as gguf-py's quant_shape_to_byte_shape
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            numpy_shape[-1] = numpy_shape[-1] // block * nbytes
            dtype = "|u1"
        tensors.append({"name": name, "type": kind, "shape": dims, "offset": start + offset, "dtype": dtype,
                        "data_shape": numpy_shape})
    return {"meta": meta, "lengths": lengths, "tensors": tensors, "tokenizer_digest": tokenizer.hexdigest()[:16]}


def _load_or_parse(path: Path) -> dict[str, Any]:
    cached = cache_dir() / "gguf-index" / f"{_key(path)}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, json.JSONDecodeError):
        pass
    index = _parse(path)
    try:  # written whole or not at all: another process may be reading the same key
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(cached)
    except (OSError, TypeError, ValueError):
        pass  # a read-only cache, or metadata JSON cannot hold: parse again next time
    return index


def tokenizer_digest(path: Path) -> str:
    """A digest of the metadata a tokenizer is built from: equal for files that differ only in their
    tensors (another quantization, a copy), so a tokenizer converted for one serves them all."""
    return _load_or_parse(path)["tokenizer_digest"]


def read_gguf(path: Path) -> tuple[list[IndexedTensor], dict[str, Any]]:
    """The file's tensors (views of the mapped file) and its metadata; the large tokenizer arrays
    stand in as range(length), enough for len()."""
    import gguf

    index = _load_or_parse(path)
    if index["size"] != path.stat().st_size:
        raise GgufError(f"{path} changed while it was read")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in index["tensors"]:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["data_shape"], dtype=np.int64))
        end = t["offset"] + count * dtype.itemsize
        if end > raw.size:
            raise GgufError(f"{path} is not a valid GGUF file: tensor {t['name']} runs past the end")
        data = raw[t["offset"]:end].view(dtype).reshape(t["data_shape"])
        tensors.append(IndexedTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), tuple(t["shape"]), data))
    meta = dict(index["meta"]) | {k: range(n) for k, n in index["lengths"].items()}
    return tensors, meta
