"""Shared-memory KV transport: the decode worker's pool lives in a memfd that the prefill worker
maps and writes into directly (one memcpy per layer per block range, no socket in between).

The memfd has no name in /dev/shm, so a killed worker leaks nothing: the memory goes when the last
process that maps it exits. Peers reach it through /proc/<pid>/fd/<fd>, which is why this backend
works only between processes of one host and one user. A worker group's pool is one memfd per
rank (kv/pool.py): the sender maps each and writes its KV heads into it.
"""

from __future__ import annotations

import socket

import torch

from tandem.disagg.worker.transport import KVEndpoint, KVReceiver, KVSender, TransferError, TransferHandle, dtype_name
from tandem.kv.pool import KVPool, PoolPart, SharedPart, map_shared


class ShmReceiver(KVReceiver):
    needs_shared_pool = True

    def _attach(self, pool: KVPool) -> KVEndpoint:
        if pool.device.type != "cpu":
            raise ValueError("the shared-memory KV transport needs a CPU pool; use --kv-transport zmq")
        shared = pool.shared_parts
        parts = tuple((where.path, *part.heads) for where, part in zip(shared, pool.parts, strict=True))
        return KVEndpoint("shm", shared[0].path, socket.gethostname(), pool.shape, dtype_name(pool.dtype), parts)


class ShmSender(KVSender):
    synchronous = True

    def __init__(self) -> None:
        super().__init__()
        self._pools: dict[str, KVPool] = {}

    def _pool(self, ep: KVEndpoint) -> KVPool:
        pool = self._pools.get(ep.address)
        if pool is None:
            if ep.host != socket.gethostname():
                raise TransferError(f"shared-memory KV pool is on host {ep.host}, not this one")
            dtype = getattr(torch, ep.dtype)
            parts = ep.parts or ((ep.address, 0, ep.pool_shape[4]),)
            try:
                pool = KVPool([PoolPart((h0, h1), map_shared(SharedPart(path, (*ep.pool_shape[:4], h1 - h0,
                                                                                  ep.pool_shape[5]), dtype)))
                               for path, h0, h1 in parts], ep.pool_shape[4])
            except (OSError, RuntimeError) as e:
                raise TransferError(f"cannot map the decode worker's KV pool ({ep.address}): {e}") from e
            self._pools[ep.address] = pool
        return pool

    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        self._pool(handle.endpoint).write_layer(layer, dst_block_ids, kv)
    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        self._complete(handle.request_id, None)  # the copies were synchronous: already in place

    def forget(self, address: str) -> None:
        """Drop the mapping of a decode worker that went away."""
        self._pools.pop(address, None)

    def close(self) -> None:
        self._pools.clear()
