"""GroupComm: the collectives a worker group's step needs, over torch.distributed (gloo on CPU,
NCCL on GPUs: chosen by device) and, between CPU processes of one x86-64 host, the shared-memory
exchange (shm.py), which is 10-50x faster than gloo for a step's small tensors.

Every rank calls the same collectives in the same order with tensors of the same shape (the step's
plan is the same on every rank); that is what makes them match. The results are bitwise equal on
every rank (sums in rank order), so the ranks never drift apart.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.parallel.shm import GroupFailed, ShmExchange

# TANDEM_GROUP_COMM=gloo forces torch.distributed for every collective (benchmarks compare the two).
COMM_ENV = "TANDEM_GROUP_COMM"
STEP_TIMEOUT_S = 600.0  # the longest one step may keep a rank waiting for another


@dataclass(frozen=True)
class GroupAddress:
    """What a rank needs to join its group: the rendezvous store's port and the shared file."""

    store_port: int
    shm_path: str | None
    slot_bytes: int


def shm_usable(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64") and \
        os.environ.get(COMM_ENV, "shm") != "gloo"


def process_group(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """A process group of its own (not torch.distributed's one default group), so one process can
    be rank 0 of several groups (a prefill group and a decode group in one test, two engines)."""
    timeout = timedelta(seconds=STEP_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class GroupComm:
    def __init__(self, rank: int, size: int, device: torch.device, address: GroupAddress,
                 store: dist.TCPStore | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        if store is None:
            store = dist.TCPStore("127.0.0.1", address.store_port, size, is_master=False,
                                  timeout=timedelta(seconds=120))
        self._store = store
        self.pg = process_group(store, rank, size, device)
        self.shm = ShmExchange(address.shm_path, rank, size, address.slot_bytes, create=False) \
            if address.shm_path is not None else None
        self.pg.barrier().wait()  # everyone has mapped the file: rank 0 unlinks it (no file outlives the group)
        if rank == 0 and address.shm_path is not None:
            os.unlink(address.shm_path)
        self.seconds: dict[str, float] = {}  # wall time in each kind of collective, waiting for peers included
        self.on_close: list[Callable[[], None]] = []  # run first by close() (rank 0: stop the followers)
        # Raise GroupFailed when a rank has gone (rank 0: its followers' processes), called between
        # steps, so that an idle group's death is noticed at once, not by the next request's step.
        self.liveness: list[Callable[[], None]] = []
        # The compiled all-reduce over the same exchange (ops/group_reduce.cpp), when the caller has it
        # (use_native): a Python exchange costs ~40 us of interpreter time here, the compiled one ~5.
        self._native_all_reduce: Callable[..., torch.Tensor] | None = None

    def use_native(self, all_reduce: Callable[..., torch.Tensor] | None) -> None:
        """all_reduce(t, address, rank, size, slot_bytes): torch.ops.tandem.group_all_reduce."""
        self._native_all_reduce = all_reduce if self.shm is not None else None

    @property
    def backend(self) -> str:
        return "shm" if self.shm is not None else self.pg.name()

    def _fits(self, nbytes: int) -> bool:
        return self.shm is not None and nbytes <= self.shm.slot_bytes

    # -- collectives ----------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of t (same shape everywhere), as a new tensor or t itself."""
        nbytes = t.numel() * t.element_size()
        if not self._fits(nbytes):
            self.pg.allreduce([t]).wait()
            return t
        assert self.shm is not None
        flat = t.contiguous().view(-1)
        parity = self.shm.exchange(flat.view(torch.uint8), STEP_TIMEOUT_S)
        parts = [self.shm.slot_view(r, parity).view(t.dtype) for r in range(self.size)]
        if self.size == 2:
            out = torch.add(parts[0], parts[1])
        else:
            acc = parts[0].to(torch.float32, copy=True)
            for p in parts[1:]:
                acc += p
            out = acc.to(t.dtype)
        return out.view(t.shape)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (shapes may differ along dim 0), in rank order."""
        if self.shm is None or t.numel() * t.element_size() > self.shm.slot_bytes:
            return [torch.as_tensor(x, device=self.device) for x in self.gather_objects(t.cpu())]
        flat = t.contiguous().view(-1).view(torch.uint8)
        parity = self.shm.exchange(flat, STEP_TIMEOUT_S)
        rest = t.shape[1:]
        return [self.shm.slot_view(r, parity).view(t.dtype).view(-1, *rest).clone() for r in range(self.size)]

    def native_group(self) -> tuple[int, int, int, int] | None:
        """(address, rank, size, slot bytes) of the shared-memory exchange, for the native layer
        stack's all-reduces (ops/group_reduce.cpp); None over torch.distributed."""
        if self.shm is None:
            return None
        return self.shm.address, self.rank, self.size, self.shm.slot_bytes

    @property
    def slot_bytes(self) -> int:
        return self.shm.slot_bytes if self.shm is not None else 0

    def _all_to_all(self, parts: list[torch.Tensor], large: bool = False) -> list[torch.Tensor]:
        """parts[r] goes to rank r (any length along dim 0, the same trailing shape everywhere);
        returns what each rank sent this one, in rank order. large: some rank sends more than a
        shared-memory slot holds (every rank must say so alike): torch.distributed carries it."""
        rest, dtype = parts[0].shape[1:], parts[0].dtype
        if self.shm is None or large:
            sizes = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
            recv_sizes = torch.empty_like(sizes)
            ones = [1] * self.size
            self.pg.alltoall_base(recv_sizes, sizes, ones, ones, dist.AllToAllOptions()).wait()
            send = torch.cat(parts)
            recv = send.new_empty((int(recv_sizes.sum()), *rest))
            self.pg.alltoall_base(recv, send, recv_sizes.tolist(), sizes.tolist(), dist.AllToAllOptions()).wait()
            return list(recv.split(recv_sizes.tolist()))
        header = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64).view(torch.uint8)
        body = torch.cat([p.contiguous().view(-1) for p in parts]).view(torch.uint8)
        parity = self.shm.exchange(torch.cat([header, body]), STEP_TIMEOUT_S)
        row = int(torch.Size(rest).numel()) * parts[0].element_size()
        out = []
        for r in range(self.size):
            view = self.shm.slot_view(r, parity)
            counts = view[:8 * self.size].view(torch.int64).tolist()
            start = 8 * self.size + row * sum(counts[:self.rank])
            out.append(view[start:start + row * counts[self.rank]].view(dtype).view(-1, *rest).clone())
        return out

    def _broadcast_object(self, obj: Any = None, patient: bool = False) -> Any:
        """Rank 0's obj on every rank (pickled). patient: the followers may wait long (for a step)."""
        if self.shm is None:
            return self._pg_broadcast_object(obj)
        payload = None
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            # A message too big for a slot goes through gloo; the slot then carries one marker byte.
            big = len(data) > self.shm.slot_bytes
            payload = torch.frombuffer(bytearray(b"\x01" if big else b"\x00" + data), dtype=torch.uint8)
        parity = self.shm.exchange(payload, None if patient else STEP_TIMEOUT_S, patient=patient)
        view = self.shm.slot_view(0, parity)
        if view[0].item() == 1:
            return self._pg_broadcast_object(obj)
        return obj if self.rank == 0 else pickle.loads(view[1:].numpy().tobytes())

    def _pg_broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj over the process group: its pickled length, then its bytes."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.pg.broadcast([n], dist.BroadcastOptions()).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if self.rank == 0 else \
            torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.pg.broadcast([buf], dist.BroadcastOptions()).wait()
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of t (same shape everywhere), as a new tensor or t itself."""
        native, shm = self._native_all_reduce, self.shm
        if native is not None and shm is not None and t.device.type == "cpu" and \
                self._fits(t.numel() * t.element_size()):  # timed by the compiled code itself (all_reduce_seconds)
            return native(t, shm.address, self.rank, self.size, shm.slot_bytes)
        with self._timed("all_reduce"):
            return self._all_reduce(t)

    @property
    def all_reduce_seconds(self) -> float:
        """Seconds in all-reduces, the native layer stack's and the compiled ones' included (waiting
        for peers included): what tensor parallelism's communication costs this rank."""
        native = self.shm.native_seconds if self.shm is not None else 0.0
        return self.seconds.get("all_reduce", 0.0) + native

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (shapes may differ along dim 0), in rank order."""
        with self._timed("all_gather"):
            return self._all_gather(t)

    def all_to_all(self, parts: list[torch.Tensor], large: bool = False) -> list[torch.Tensor]:
        """parts[r] goes to rank r; what each rank sent this one, in rank order (see _all_to_all)."""
        with self._timed("all_to_all"):
            return self._all_to_all(parts, large)

    def broadcast_object(self, obj: Any = None, patient: bool = False) -> Any:
        """Rank 0's obj on every rank (pickled). patient: the followers may wait long (for a step)."""
        with self._timed("broadcast"):
            return self._broadcast_object(obj, patient)

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        except RuntimeError as e:  # gloo's word for a peer that went away
            if isinstance(e, GroupFailed | ValueError):
                raise
            raise GroupFailed(f"a collective failed: {e}") from e
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order (pickled: their lengths, then their bytes padded alike)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64, device=self.device)]).wait()
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.pg.allgather([parts], [mine.to(self.device)]).wait()
        return [pickle.loads(p[:int(n.item())].cpu().numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)]

    def check_alive(self) -> None:
        for check in self.liveness:
            check()

    def close(self) -> None:
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            hook()
        with contextlib.suppress(RuntimeError):  # its connections go now, not when the object does
            self.pg.shutdown()


def start_rendezvous(size: int, slot_bytes: int, device: torch.device) -> tuple[dist.TCPStore, GroupAddress]:
    """Rank 0's side of the rendezvous: the store on a free loopback port and the shared file."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    shm_path = None
    if shm_usable(device):
        shm_path = f"/dev/shm/tandem-group-{os.getpid()}-{store.port}"
        ShmExchange(shm_path, 0, size, slot_bytes, create=True)
    return store, GroupAddress(store.port, shm_path, slot_bytes)

