"""Prefix-cache block hashes, chained through the parent block's hash.

A block's identity is (parent hash, its token ids, extra keys such as the tenant's cache salt),
so equal hashes mean equal whole prefixes, and different salts never collide into one block.
Keys must be equal in every process and on every host (the KV store and a KV-aware router match
them across both), so the extra keys are encoded as integers before any hash function sees them:
Python's hash of a str (or of None) differs per process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

ExtraKey = int | str | bytes
# (parent hash, the block's token ids, the extra keys as stable integers) -> the block's hash.
HashFn = Callable[[int | None, Sequence[int], tuple[int, ...]], int]


ROOT = 0x5EED  # the first block's parent: hash(None) is an address on Python 3.11, different per process


def stable_int(value: ExtraKey) -> int:
    """An extra key as an integer equal in every process: ints as they are, strings and bytes through
    sha256 (their builtin hashes are randomised per process by PYTHONHASHSEED)."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return int.from_bytes(hashlib.sha256(value).digest()[:8], "little")
    raise TypeError(f"a block key's extras must be int, str or bytes, got {type(value).__name__}")


def stable_extra(extra: Sequence[ExtraKey]) -> tuple[int, ...]:
    return tuple(stable_int(v) for v in extra)


def builtin_hash(parent: int | None, tokens: Sequence[int], extra: tuple[int, ...]) -> int:
    # Tuples of ints hash deterministically across processes (no PYTHONHASHSEED), which the
    # KV-aware router needs; the root's missing parent is ROOT.
    return hash((ROOT if parent is None else parent, tuple(tokens), extra))


def sha256_hash(parent: int | None, tokens: Sequence[int], extra: tuple[int, ...]) -> int:
    """The same value on every process, host and Python version: the keys of the shared KV store."""
    h = hashlib.sha256(b"root" if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens))
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": builtin_hash, "sha256": sha256_hash}


def salt_key(salt: str | None) -> tuple[int, ...]:
    """Extra keys for a request's cache salt (none without one)."""
    return () if salt is None else (stable_int(salt),)


def block_keys(token_ids: Sequence[int], block_size: int, algo: str, key_extra: Sequence[ExtraKey],
               salt: str | None) -> list[int]:
    """The keys of token_ids' full blocks, as an engine keyed with key_extra computes them."""
    keys: list[int] = []
    extend_block_hashes(keys, token_ids, block_size, HASH_FUNCTIONS[algo], (*key_extra, *salt_key(salt)))
    return keys


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, hash_fn: HashFn,
                        extra: Sequence[ExtraKey]) -> None:
    """Append the hashes of every newly completed full block of token_ids to hashes."""
    starts = range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size)
    if not starts:  # most calls (a decode step's request): no block completed, nothing to encode
        return
    key = stable_extra(extra)
    for start in starts:
        parent = hashes[-1] if hashes else None
        hashes.append(hash_fn(parent, token_ids[start:start + block_size], key))
