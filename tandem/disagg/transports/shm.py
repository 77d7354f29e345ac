"""Shared-memory KV transport: the decode worker's pool lives in a memfd that the prefill worker
maps and writes into directly (one memcpy per layer per block range, no socket in between).

The memfd has no name in /dev/shm, so a killed worker leaks nothing: the memory goes when the last
process that maps it exits. Peers reach it through /proc/<pid>/fd/<fd>, which is why this backend
works only between processes of one host and one user.
"""

from __future__ import annotations

import math
import os
import socket

import torch

from tandem.disagg.transport import KVEndpoint, KVReceiver, KVSender, TransferError, TransferHandle, dtype_name


def map_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class ShmReceiver(KVReceiver):
    def __init__(self) -> None:
        super().__init__()
        self._fd: int | None = None

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError("the shared-memory KV transport needs a CPU pool; use --kv-transport zmq")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._fd = os.memfd_create("tandem-kv-pool")
        os.ftruncate(self._fd, nbytes)  # sparse: pages are allocated as blocks are first written
        path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.pool = map_pool(path, shape, dtype)
        self._endpoint = KVEndpoint("shm", path, socket.gethostname(), tuple(shape), dtype_name(dtype))
        return self.pool

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ShmSender(KVSender):
    synchronous = True

    def __init__(self) -> None:
        super().__init__()
        self._pools: dict[str, torch.Tensor] = {}

    def _pool(self, ep: KVEndpoint) -> torch.Tensor:
        pool = self._pools.get(ep.address)
        if pool is None:
            if ep.host != socket.gethostname():
                raise TransferError(f"shared-memory KV pool is on host {ep.host}, not this one")
            try:
                pool = map_pool(ep.address, ep.pool_shape, getattr(torch, ep.dtype))
            except (OSError, RuntimeError) as e:
                raise TransferError(f"cannot map the decode worker's KV pool ({ep.address}): {e}") from e
            self._pools[ep.address] = pool
        return pool

    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        self._pool(handle.endpoint)[layer][:, dst_block_ids] = kv

    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        self._complete(handle.request_id, None)  # the copies were synchronous: already in place

    def forget(self, address: str) -> None:
        """Drop the mapping of a decode worker that went away."""
        self._pools.pop(address, None)

    def close(self) -> None:
        self._pools.clear()
