"""A GGUF file's metadata and tensor table, read once with gguf-py and kept in the cache.

gguf-py's reader decodes every metadata field eagerly, the tokenizer's 49k tokens and merges one
numpy view at a time: 4.8 of the 5.1 seconds a load of the default model took, in every process
that loads it (each server's core, each worker). The tokenizer is cached apart (loader.py), so a
load needs only the scalar metadata and where each tensor lies. Those are written to the cache
the first time (keyed by the file's path, size and mtime, and gguf-py's version); afterwards the
file is mapped once and each tensor is a view into it, exactly the dtype and shape gguf-py gives.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from tandem.cache import cache_dir

FORMAT = 1
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
    ident = f"{FORMAT}:{version('gguf')}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _parse(path: Path) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        meta: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for key, field in reader.fields.items():
            if key in LARGE_ARRAYS:
                lengths[key] = len(field.data)
            else:
                meta[key] = field.contents()
        tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                    "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
                   for t in reader.tensors]
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise GgufError(f"{path} is not a valid GGUF file: {e}") from e
    return {"meta": meta, "lengths": lengths, "tensors": tensors, "size": path.stat().st_size}


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
