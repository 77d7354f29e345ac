"""Picks a KV transport backend: by flag for a decode worker's receiver, by each handle's endpoint for
a prefill worker's sender. It sits above the backends (they import only the interface,
disagg/worker/transport.py), so nothing below it knows which backends exist."""

from __future__ import annotations

import torch

from tandem.disagg.worker.transport import KVReceiver, KVSender, TransferError, TransferHandle
from tandem.disagg.worker.transports.shm import ShmReceiver, ShmSender
from tandem.disagg.worker.transports.zmq_tcp import ZmqReceiver, ZmqSender


def make_receiver(kind: str, host: str = "127.0.0.1", port: int = 0, secret: bytes = b"") -> KVReceiver:
    if kind == "shm":
        return ShmReceiver()
    if kind == "zmq":
        return ZmqReceiver(host, port, secret)
    raise ValueError(f"unknown KV transport {kind!r} (choose shm or zmq)")


class RoutingSender(KVSender):
    """Picks the backend from each handle's endpoint, so one prefill worker can feed decode workers
    on its own host (shared memory) and on others (TCP) at once."""

    def __init__(self, secret: bytes) -> None:
        super().__init__()
        self.secret = secret
        self._backends: dict[str, KVSender] = {}

    def _backend(self, kind: str) -> KVSender:
        b = self._backends.get(kind)
        if b is None:
            if kind == "shm":
                b = ShmSender()
            elif kind == "zmq":
                b = ZmqSender(self.secret)
            else:
                raise TransferError(f"unknown KV transport {kind!r}")
            b._complete = self._complete  # results land in this sender's queue
            self._backends[kind] = b
        return b

    def _is_synchronous(self, handle: TransferHandle) -> bool:
        return self._backend(handle.endpoint.kind).synchronous

    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        self._backend(handle.endpoint.kind)._write(handle, layer, dst_block_ids, kv)

    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        self._backend(handle.endpoint.kind)._finish(handle, num_bytes)

    def _check(self) -> None:
        for b in self._backends.values():
            b._check()

    def forget(self, address: str) -> None:
        """A decode worker went away: drop what points at it and fail transfers waiting on it."""
        for b in self._backends.values():
            b.forget(address)

    def close(self) -> None:
        for b in self._backends.values():
            b.close()
