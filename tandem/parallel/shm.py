"""Collectives between the processes of one host through one shared file.

gloo's all-reduce of a decode step's few KiB takes 1.4-1.7 ms on this machine (tests: a 2-process
probe, benchmarks/tensor_parallel.py), while a step's layers call one per row-parallel layer: 60 a
step for the default model. Here every collective is one exchange: each rank copies its bytes into
its own slot and then bumps its counter; when every counter has reached the exchange's sequence
number, each rank reads whatever slots it needs (sums them for an all-reduce, concatenates them for
an all-gather, picks its part of each for an all-to-all). Two slots a rank, alternating by sequence
number, make a slot safe to overwrite: a rank can only reach exchange s + 2 once every rank has
published s + 1, which each does after it has read exchange s.

The order of the copy and the counter store is what x86's memory model (TSO) guarantees to other
cores; comm.py uses this only on x86-64 CPUs. Waiting spins (a peer is microseconds away in a step),
then yields, then sleeps (an idle follower waiting for the next step costs no core); a peer that dies
is noticed by its pid and raises GroupFailed instead of waiting for ever.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

LINE = 64  # one counter per cache line: ranks never write the same line
PATIENT_YIELD_S = 0.02  # a follower between steps yields this long before it sleeps
HEADER = 4096


class GroupFailed(RuntimeError):
    """A rank of the group died or stopped answering: the group's steps cannot go on."""


def process_alive(pid: int) -> bool:
    """True unless pid is gone or a zombie (a dead sibling stays a zombie until its parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


class ShmExchange:
    """One rank's view of the shared file: the counters and lengths, and two slots per rank."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        total = HEADER + 2 * size * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self.mem = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
        # The header as 64-bit words (a Python read of one is ~50 ns; numpy's scalars take microseconds):
        # rank r's counter at word 8r (a cache line each), its two slots' lengths, its pid and the
        # nanoseconds its compiled all-reduces took (ops/group_reduce.cpp adds them) after them.
        assert size * LINE + size * 32 <= HEADER
        self.words = memoryview(self.mem[:HEADER]).cast("q")
        self.address = int(self.mem.ctypes.data)  # where the file is mapped here (for ops/group_reduce.cpp)
        self._length = size * LINE // 8
        self._pid = self._length + 2 * size
        self._native_ns = self._pid + size
        slots = torch.from_numpy(self.mem[HEADER:].view(np.uint8))
        self.slots = slots.view(size, 2, slot_bytes)
        self.words[self._pid + rank] = os.getpid()
        self.seq = 0

    def exchange(self, payload: torch.Tensor | None, timeout_s: float | None, patient: bool = False) -> int:
        """Publish payload (bytes, uint8; None: nothing) and wait until every rank has published this
        exchange. Returns the parity whose slots now hold everyone's bytes (slot_view reads them).
        timeout_s None: wait as long as the peers live. patient: a long wait is expected (a follower
        waiting for the next step): sleep sooner."""
        # The counter holds the last exchange this rank published, from here or from the native layer
        # stack's all-reduces (ops/group_reduce.cpp), which use this same file.
        self.seq = self.words[self.rank * LINE // 8] + 1
        parity = self.seq & 1
        n = 0 if payload is None else payload.numel()
        if n > self.slot_bytes:
            raise ValueError(f"{n} bytes exceed the exchange's slot of {self.slot_bytes}")
        if n:
            self.slots[self.rank, parity, :n].copy_(payload)
        self.words[self._length + 2 * self.rank + parity] = n
        self.words[self.rank * LINE // 8] = self.seq  # after the bytes: TSO keeps the two stores in this order
        self._wait(timeout_s, patient)
        return parity


    @property
    def native_seconds(self) -> float:
        """Seconds this rank spent in compiled all-reduces (waiting for the peers included)."""
        return self.words[self._native_ns + self.rank] / 1e9

    def slot_view(self, rank: int, parity: int) -> torch.Tensor:
        return self.slots[rank, parity, :self.words[self._length + 2 * rank + parity]]

    def _wait(self, timeout_s: float | None, patient: bool) -> None:
        words, seq, stride = self.words, self.seq, LINE // 8
        limit = 64 if patient else 20000  # spins before yielding: a step's peer is microseconds away
        for r in range(self.size):
            spins = 0
            while words[r * stride] < seq:
                spins += 1
                if spins > limit:
                    self._wait_long(r, timeout_s, patient)
                    break

    def _wait_long(self, rank: int, timeout_s: float | None, patient: bool) -> None:
        """Yield the core, then sleep (an idle follower waiting for the next step costs no core),
        checking now and then that the peers are alive. A follower waiting for the next step yields
        for as long as rank 0 usually takes between two steps (sampling, scheduling: milliseconds),
        so it starts the step at once rather than a sleep's length late."""
        word, start, turns = rank * LINE // 8, time.monotonic(), 0
        yield_s = PATIENT_YIELD_S if patient else 0.002
        while self.words[word] < self.seq:
            turns += 1
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                raise GroupFailed(f"rank {rank} of the worker group did not answer in {timeout_s:.0f} s")
            if turns % 64 == 0:
                self._check_peers()
            if now - start < yield_s:
                os.sched_yield()
            else:
                time.sleep(min(0.001, (now - start) / 8) if patient else 0.0002)

    def _check_peers(self) -> None:
        for r in range(self.size):
            pid = self.words[self._pid + r]
            if r != self.rank and self.words[r * LINE // 8] < self.seq and pid and not process_alive(pid):
                raise GroupFailed(f"rank {r} of the worker group (pid {pid}) died")
