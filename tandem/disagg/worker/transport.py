"""The KV transfer interface: move the bytes of block ranges from a prefill worker's pool into the
blocks a decode worker reserved, one layer at a time.

The decode side (KVReceiver) owns its pool and says where to write (a KVEndpoint inside every
TransferHandle); the prefill side (KVSender) writes layer slices as the model finishes each layer
and reports when everything it wrote has landed. Writes are accepted only into blocks of an open
reservation, so a late write can never touch blocks that were given to someone else.

Backends (transports/): shared memory on one host (the decode pool lives in a memfd the prefill
worker maps and writes straight into) and ZeroMQ over TCP across hosts (signed with the shared
secret); transports/factory.py picks one. Another backend (Mooncake's transfer engine, RDMA) fits
the same two classes: write = one remote write of a block range, finish = a fence.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router imports these types and holds no tensors: it never imports torch
    import torch

    from tandem.kv.pool import KVPool


class TransferError(RuntimeError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVEndpoint:
    kind: str  # "shm" or "zmq"
    address: str  # shm: the path of the pool's first part (its identity); zmq: tcp://host:port
    host: str  # shm works only from this host
    pool_shape: tuple[int, ...]  # [layers, 2, blocks, block_size, kv_heads, head_dim]: every KV head
    dtype: str
    # shm: each part of the pool (a worker group's ranks' KV heads): (path, first head, end head).
    parts: tuple[tuple[str, int, int], ...] = ()


@dataclass
class TransferHandle:
    """The decode worker's answer to a reservation: where each prompt block's KV goes."""

    request_id: str
    block_ids: list[int]  # decode-side block of prompt block i
    num_cached_blocks: int  # leading blocks the decode worker already holds: not sent
    endpoint: KVEndpoint
    worker_id: str = ""


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0
    copy_s: float = 0.0  # spent on the compute thread issuing writes
    window_s: float = 0.0  # first write to confirmed landing (synchronous backends: the copies)
    wait_s: float = 0.0  # end of compute to confirmed landing (not hidden)

    @property
    def hidden_s(self) -> float:
        """The part of the transfer window during which the model went on computing: layer i's KV
        in flight while layer i+1 runs. Zero for a synchronous backend."""
        return max(self.window_s - self.copy_s - self.wait_s, 0.0)


@dataclass
class _Progress:
    handle: TransferHandle
    synchronous: bool = False  # every write completes before write() returns: nothing overlaps
    num_bytes: int = 0
    copy_s: float = 0.0
    first_write: float | None = None
    finished: float | None = None
    error: str | None = None


class KVSender(ABC):
    """Prefill side. write() and finish() run on the engine thread; poll() reports results."""

    synchronous = False  # a backend whose writes land before write() returns (a memcpy) says so

    def __init__(self) -> None:
        self._progress: dict[str, _Progress] = {}
        self._done: list[TransferResult] = []

    def write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        """kv: [2, len(dst_block_ids), block_size, kv_heads, head_dim], this layer's K and V."""
        p = self._progress.get(handle.request_id)
        if p is None:
            p = self._progress[handle.request_id] = _Progress(handle, self._is_synchronous(handle))
        if p.error is not None:
            return
        t0 = time.perf_counter()
        if p.first_write is None:
            p.first_write = t0
        try:
            self._write(handle, layer, dst_block_ids, kv)
        except Exception as e:  # reported through poll(), never raised into the model's forward
            p.error = f"{type(e).__name__}: {e}"
        p.num_bytes += kv.numel() * kv.element_size()
        p.copy_s += time.perf_counter() - t0

    def finish(self, handle: TransferHandle) -> None:
        """Everything for this request is written; its result comes from poll() once it has landed."""
        p = self._progress.setdefault(handle.request_id, _Progress(handle))
        p.finished = time.perf_counter()
        if p.first_write is None:
            p.first_write = p.finished  # nothing to send: the decode worker had it all cached
        if p.error is None:
            try:
                self._finish(handle, p.num_bytes)
                return
            except Exception as e:
                p.error = f"{type(e).__name__}: {e}"
        self._complete(handle.request_id, p.error)

    def abort(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def _complete(self, request_id: str, error: str | None) -> None:
        p = self._progress.pop(request_id, None)
        if p is None:
            return
        now = time.perf_counter()
        error = error or p.error
        if p.synchronous:  # the copies were the whole transfer, all of it on the compute thread
            self._done.append(TransferResult(request_id, error is None, error, p.num_bytes, p.copy_s, p.copy_s))
            return
        finished = p.finished if p.finished is not None else now
        start = p.first_write if p.first_write is not None else finished
        self._done.append(TransferResult(request_id, error is None, error, p.num_bytes, p.copy_s, now - start,
                                         now - finished))

    def _is_synchronous(self, handle: TransferHandle) -> bool:
        return self.synchronous

    def poll(self) -> list[TransferResult]:
        self._check()
        done, self._done = self._done, []
        return done

    def _check(self) -> None:  # noqa: B027 (asynchronous backends collect confirmations here)
        pass

    def forget(self, address: str) -> None:  # noqa: B027
        pass

    @abstractmethod
    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None: ...

    @abstractmethod
    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        """Arrange for _complete(request_id, error) once every write has landed."""

    def close(self) -> None:  # noqa: B027
        pass


class KVReceiver(ABC):
    """Decode side: writes into the engine's pool (every KV head, kv/pool.py) and guards which blocks
    may be written."""

    needs_shared_pool = False  # the sender maps the pool itself: it must be in shared memory

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, frozenset[int]] = {}
        self.pool: KVPool | None = None
        self._endpoint: KVEndpoint | None = None  # set by attach
        self.bytes_received = 0

    def attach(self, pool: KVPool) -> None:
        """Receive into this pool from now on."""
        self.pool = pool
        self._endpoint = self._attach(pool)

    @abstractmethod
    def _attach(self, pool: KVPool) -> KVEndpoint:
        """Get ready to receive into pool; where senders reach it."""

    @property
    def endpoint(self) -> KVEndpoint:
        if self._endpoint is None:
            raise RuntimeError("attach() a pool first")
        return self._endpoint

    def open(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._open[request_id] = frozenset(block_ids)

    def close(self, request_id: str) -> None:
        """After this returns no write for the request lands: its blocks may be reused."""
        with self._lock:
            self._open.pop(request_id, None)

    def _write_locked(self, request_id: str, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        with self._lock:
            allowed = self._open.get(request_id)
            if allowed is None:
                raise TransferError(f"no open reservation for {request_id!r}")
            if not allowed.issuperset(dst_block_ids):
                raise TransferError(f"write outside the blocks reserved for {request_id!r}")
            assert self.pool is not None
            self.pool.write_layer(layer, dst_block_ids, kv)
            self.bytes_received += kv.numel() * kv.element_size()

    def shutdown(self) -> None:  # noqa: B027
        pass


@dataclass
class TransferStats:
    """Running totals a worker reports in its heartbeat; the router exports them per role."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfer_s: float = 0.0
    hidden_s: float = 0.0
    exposed_s: float = 0.0
    reservations: int = 0
    reservations_refused: int = 0

    def add(self, r: TransferResult) -> None:
        if r.ok:
            self.transfers_ok += 1
            self.bytes_sent += r.num_bytes
            self.transfer_s += r.window_s
            self.hidden_s += r.hidden_s
            self.exposed_s += r.copy_s + r.wait_s
        else:
            self.transfers_failed += 1
