"""The cached GGUF index gives exactly what gguf-py's reader gives: every tensor's type, shape, dtype
and bytes, and the metadata, whether it was just parsed or read back from the cache."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.gguf_index import read_gguf, tokenizer_digest


def test_the_index_matches_gguf_py_cold_and_warm(default_model_path: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    reader = gguf.GGUFReader(default_model_path)
    cold = read_gguf(default_model_path)
    assert list((tmp_path / "gguf-index").glob("*.json")), "the index was cached"
    warm = read_gguf(default_model_path)
    for tensors, meta in (cold, warm):
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(tensors, reader.tensors, strict=True):
            assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(int(d) for d in theirs.shape)
            assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
            assert np.array_equal(ours.data, theirs.data) and not ours.data.flags.writeable
        for key, field in reader.fields.items():
            if key.startswith("tokenizer.ggml.") and key in meta and isinstance(meta[key], range):
                assert len(meta[key]) == len(field.data)  # the large arrays: their lengths
            else:
                assert meta[key] == field.contents(), key


def write_gguf(path: Path, values: np.ndarray, tokens: list[str] | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
    writer.add_tensor("token_embd.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_changed_file_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, np.arange(32, dtype=np.float32).reshape(4, 8))
    [tensor], meta = read_gguf(path)
    assert meta["llama.block_count"] == 1 and np.array_equal(tensor.data, np.arange(32).reshape(4, 8))
    before = path.stat().st_mtime_ns
    write_gguf(path, -np.arange(32, dtype=np.float32).reshape(4, 8))  # same size, new bytes
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a later mtime even on a coarse-clock filesystem
    [again], _ = read_gguf(path)
    assert np.array_equal(again.data, -np.arange(32).reshape(4, 8))
    assert len(list((tmp_path / "cache" / "gguf-index").glob("*.json"))) == 2


def test_files_with_one_tokenizer_share_its_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer's digest covers the metadata a tokenizer is built from, not the tensors: files that
    differ only in their weights (another quantization, a copy) convert their tokenizer once."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    paths = [tmp_path / f"{name}.gguf" for name in ("a", "b", "c", "d")]
    write_gguf(paths[0], np.zeros((4, 8), np.float32), ["x", "y", "z"])
    write_gguf(paths[1], np.ones((4, 8), np.float32), ["x", "y", "z"])  # other weights
    write_gguf(paths[2], np.zeros((4, 8), np.float32), ["x", "y", "w"])  # another vocabulary
    write_gguf(paths[3], np.zeros((4, 8), np.float32))  # none
    a, b, c, d = (tokenizer_digest(p) for p in paths)
    assert a == b and len({a, c, d}) == 3
