"""Prefix-cache block hashes, chained through the parent block's hash.

A block's identity is (parent hash, its token ids, extra keys such as the tenant's cache salt),
so equal hashes mean equal whole prefixes, and different salts never collide into one block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

HashFn = Callable[[int | None, Sequence[int], tuple], int]


ROOT = 0x5EED  # the first block's parent: hash(None) is an address on Python 3.11, different per process


def builtin_hash(parent: int | None, tokens: Sequence[int], extra: tuple) -> int:
    # Tuples of ints hash deterministically across processes (no PYTHONHASHSEED), which the
    # KV-aware router needs; string salts are turned into ints by salt_key() first, and the root's
    # missing parent into ROOT.
    return hash((ROOT if parent is None else parent, tuple(tokens), extra))


def sha256_hash(parent: int | None, tokens: Sequence[int], extra: tuple) -> int:
    """The same value on every process, host and Python version: the keys of the shared KV store."""
    h = hashlib.sha256(b"root" if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens))
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": builtin_hash, "sha256": sha256_hash}


def salt_key(salt: str | None) -> tuple:
    """Extra keys for a request: a stable integer for the salt (str hashes vary per process)."""
    if salt is None:
        return ()
    return (int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little"),)


def block_keys(token_ids: Sequence[int], block_size: int, algo: str, key_extra: tuple, salt: str | None) -> list[int]:
    """The keys of token_ids' full blocks, as an engine keyed with key_extra computes them."""
    keys: list[int] = []
    extend_block_hashes(keys, token_ids, block_size, HASH_FUNCTIONS[algo], key_extra + salt_key(salt))
    return keys


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, hash_fn: HashFn,
                        extra: tuple) -> None:
    """Append the hashes of every newly completed full block of token_ids to hashes."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_fn(parent, token_ids[start:start + block_size], extra))
