"""The KV pool as a whole model's KV: one tensor, or in a worker group every rank's share of the KV heads.

A worker group's ranks each hold their KV heads of every block ([layers, 2, blocks, block_size,
their heads, row]). Whatever moves KV in or out of the pool (a disaggregated prefill sending it, a
decode worker receiving it, the tiered store saving and loading it) works on whole blocks with
every KV head, in rank 0's process: so on a CPU, rank 0 allocates every rank's pool in shared
memory (a memfd each; a follower maps its own through /proc/<pid>/fd/<fd>) and reads and writes
them all through this view, with no collective and no step of the followers' in between.

Ordering: a rank writes its KV of layer i before its share of layer i's o_proj all-reduce, so once
rank 0 is past layer i every rank's KV of layer i is in place; blocks written here (a landed
transfer, a store load) are read by a follower only after rank 0's next step broadcast, which
orders them.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy has no bfloat16


@dataclass(frozen=True)
class SharedPart:
    """Where a process maps a shared pool part from."""

    path: str  # /proc/<pid>/fd/<fd> of the memfd
    shape: tuple[int, ...]
    dtype: torch.dtype


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedPart]:
    """A zeroed CPU tensor in a memfd that other processes of this user and host can map. The memfd
    has no name, so a killed process leaks nothing; its descriptor closes when the mapping goes."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    fd = os.memfd_create("tandem-kv-pool")
    os.ftruncate(fd, nbytes)  # sparse: pages are allocated as blocks are first written
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # honoured where the kernel's shmem policy allows it
        mapping.madvise(mmap.MADV_HUGEPAGE)
    weakref.finalize(mapping, os.close, fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    return tensor, SharedPart(f"/proc/{os.getpid()}/fd/{fd}", tuple(shape), dtype)


def map_shared(part: SharedPart) -> torch.Tensor:
    return torch.from_file(part.path, shared=True, size=math.prod(part.shape), dtype=part.dtype).view(part.shape)


@dataclass(frozen=True)
class PoolPart:
    heads: tuple[int, int]  # the whole model's KV heads this tensor holds
    tensor: torch.Tensor  # [layers, 2, blocks, block_size, heads[1] - heads[0], row]
    shared: SharedPart | None = None


class KVPool:
    """Every KV head of the pool's blocks. parts may repeat a head (ranks that share a KV head hold
    equal copies): reads take each head once, writes go to every copy."""

    def __init__(self, parts: list[PoolPart], num_kv_heads: int | None = None) -> None:
        self.parts = parts
        self.local = parts[0].tensor  # this process's own part: the one its model runs on
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else max(p.heads[1] for p in parts)
        covered: set[int] = set()
        self._readers: list[PoolPart] = []  # the parts reads take, each covering heads not yet taken
        for p in parts:
            heads = set(range(*p.heads))
            if heads - covered:
                if heads & covered:
                    raise ValueError("pool parts overlap only as whole copies of each other's heads")
                self._readers.append(p)
                covered |= heads
        self.complete = covered == set(range(self.num_kv_heads))
        self._one = len(parts) == 1 and self.complete  # the plain pool of a one-process engine
        self._np = [p.tensor.view(_INT_OF_SIZE[p.tensor.element_size()]).numpy() if p.tensor.device.type == "cpu"
                    else None for p in parts]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> KVPool:
        return cls([PoolPart((0, tensor.shape[4]), tensor)])

    @classmethod
    def in_shared_memory(cls, shape: tuple[int, ...], dtype: torch.dtype) -> KVPool:
        tensor, where = shared_zeros(shape, dtype)
        return cls([PoolPart((0, shape[4]), tensor, where)])

    @property
    def shape(self) -> tuple[int, ...]:
        """[layers, 2, blocks, block_size, every KV head, row]."""
        layers, two, blocks, block_size, _, row = self.local.shape
        return (layers, two, blocks, block_size, self.num_kv_heads, row)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def block_nbytes(self) -> int:
        """A block of every layer and head."""
        return math.prod(self.shape) // self.shape[2] * self.local.element_size()

    @property
    def nbytes(self) -> int:
        return sum(p.tensor.numel() * p.tensor.element_size() for p in self.parts)

    @property
    def shared_parts(self) -> list[SharedPart]:
        if any(p.shared is None for p in self.parts):
            raise ValueError("this KV pool is not in shared memory")
        return [p.shared for p in self.parts]  # type: ignore[misc]

    def _check(self) -> None:
        if not self.complete:
            raise RuntimeError(f"this process sees {self._readers[0].heads} of the pool's {self.num_kv_heads} "
                               "KV heads: the worker group's pools are not shared with it")

    def read_layer(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """[2, len(blocks), block_size, every head, row] of one layer."""
        if self._one:
            return self.local[layer].index_select(1, blocks)
        self._check()
        return torch.cat([p.tensor[layer].index_select(1, blocks) for p in self._readers], dim=3)

    def write_layer(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """kv: [2, len(block_ids), block_size, every head, row] of one layer."""
        if self._one:
            self.local[layer][:, block_ids] = kv
            return
        self._check()
        for p in self.parts:
            p.tensor[layer][:, block_ids] = kv[:, :, :, p.heads[0]:p.heads[1]]

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, layers, 2, block_size, every head, row]: each block's layers contiguous, on the CPU."""
        self._check()
        parts = [p.tensor.index_select(2, block_ids).movedim(2, 0) for p in self._readers]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=4)
        return out.contiguous().cpu()

    def write_block(self, block_id: int, raw: np.ndarray) -> None:
        """raw: one block's bytes as read_blocks lays them out. A CPU pool is written through numpy: a
        plain memcpy, where a torch copy on a loader thread would start an OpenMP team that fights
        the engine's threads for the cores."""
        self._check()
        layers, two, _, block_size, heads, row = self.shape
        for p, np_view in zip(self.parts, self._np, strict=True):
            h0, h1 = p.heads
            if np_view is not None:
                src = raw.view(np_view.dtype).reshape(layers, two, block_size, heads, row)
                np.copyto(np_view[:, :, block_id], src[:, :, :, h0:h1])
            else:
                src_t = torch.from_numpy(raw).view(self.dtype).view(layers, two, block_size, heads, row)
                p.tensor[:, :, block_id].copy_(src_t[:, :, :, h0:h1])
