"""The disk tier: one file per block under a directory, written by a background thread, kept across restarts.

A block lives in <dir>/<2 hex>/<16 hex>.kv (its key as unsigned hex): the entry header, then the
payload. The writer writes a temp file named with its pid, then os.replace()s it into place, so a
killed process leaves at worst a temp file (removed by the next tier to start, once that pid is
gone), never a torn .kv. There is no fsync: after a power loss a file may hold garbage, which fails
its digest and costs a recompute, as any corrupt file does.

The index (key -> mtime, least recently used first) is this process's: rebuilt from a scan at start,
then kept in memory, learning the files other processes wrote when contains() or load() find them.
Blocks are all one size, so the capacity is a block count, enforced over the files this process
knows: processes sharing a directory should each be given their share. Load hits set the file's
mtime, so the LRU order survives a restart. The pin is POSIX's: a file evicted (unlinked) or
replaced while a load has it open keeps its inode until closed, so no eviction tears a read.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from contextlib import suppress

import numpy as np

from tandem.kv.store.host_tier import _as_bytes
from tandem.kv.store.tier import HEADER, EntryHeader, KVTier, TierStats, pack_header

logger = logging.getLogger(__name__)

STALE_TEMP_S = 600.0  # a temp file this old is removed even if its pid is alive (reused pids)
_temp_seq = itertools.count()


def _key_of(hex16: str) -> int:
    u = int(hex16, 16)
    return u - (1 << 64) if u >= 1 << 63 else u


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another tier of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_nbytes: int, ttl_s: float | None = None,
                 queue_depth: int = 64) -> None:
        self.directory, self.block_nbytes, self.ttl_s = directory, block_nbytes, ttl_s
        self.entry_nbytes = HEADER.size + block_nbytes
        self.capacity_blocks = capacity_bytes // self.entry_nbytes if block_nbytes > 0 else 0
        if self.capacity_blocks < 1:
            raise ValueError(f"disk tier: {capacity_bytes} bytes hold no block of {block_nbytes} bytes")
        self.dropped_saves = 0  # saves refused because the writer's queue was full
        self._lock = threading.Lock()  # the index, the pending saves, the counters
        self._index: OrderedDict[int, float] = OrderedDict()
        self._pending: dict[int, bytes] = {}  # queued, not yet on disk: loads are served from here
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(queue_depth)
        self._stats = TierStats(capacity_blocks=self.capacity_blocks)
        self._closed = False
        os.makedirs(directory, exist_ok=True)
        self._scan()
        self._unlink(self._make_room(0))  # the capacity may be smaller than last time
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path_for(self, key: int) -> str:
        h = f"{key & 0xFFFF_FFFF_FFFF_FFFF:016x}"
        return os.path.join(self.directory, h[:2], f"{h}.kv")

    def _scan(self) -> None:
        found: list[tuple[float, int]] = []
        now = time.time()
        for sub in os.scandir(self.directory):
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                with suppress(OSError, ValueError, IndexError):  # vanished under us, or not a name of ours
                    if e.name.endswith(".tmp"):  # <16 hex>.kv.<pid>.<seq>.tmp, left by a killed writer?
                        if not _alive(int(e.name.split(".")[-3])) or now - e.stat().st_mtime > STALE_TEMP_S:
                            os.unlink(e.path)
                    elif e.name.endswith(".kv") and len(e.name) == 19:
                        st = e.stat()
                        if st.st_size == self.entry_nbytes:
                            found.append((st.st_mtime, _key_of(e.name[:16])))
                        else:  # another block size: never loadable here
                            os.unlink(e.path)
        self._index.update((k, m) for m, k in sorted(found))

    def _expired(self, h: EntryHeader) -> bool:
        return self.ttl_s is not None and time.time() - h.stored_at > self.ttl_s

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for field, d in deltas.items():
                setattr(self._stats, field, getattr(self._stats, field) + d)

    def _make_room(self, incoming: int) -> list[int]:
        """Take the least recently used keys off the index until `incoming` more blocks fit."""
        with self._lock:
            victims = []
            while self._index and len(self._index) + incoming > self.capacity_blocks:
                victims.append(self._index.popitem(last=False)[0])
            self._stats.evictions += len(victims)
            return victims

    def _unlink(self, keys: list[int]) -> None:
        for k in keys:
            with suppress(FileNotFoundError):
                os.unlink(self.path_for(k))

    def contains(self, key: int) -> bool:
        with self._lock:
            if key in self._pending or key in self._index:
                return True
        try:
            ok = os.stat(self.path_for(key)).st_size == self.entry_nbytes  # another process's file?
        except OSError:
            ok = False
        with self._lock:
            if ok:
                self._index.setdefault(key, time.time())
            else:
                self._stats.misses += 1  # a lookup that found nothing usable (the load after a True counts)
        return ok

    def save(self, key: int, payload: memoryview) -> None:
        src = _as_bytes(payload, self.block_nbytes, "payload")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            if self._closed or key in self._index or key in self._pending:
                return
        data = src.tobytes()  # the caller's buffer is reused as soon as this returns
        with self._lock:
            if key in self._pending:
                return
            self._pending[key] = data
        try:
            self._queue.put_nowait((key, data))
        except queue.Full:
            with self._lock:
                del self._pending[key]
                self.dropped_saves += 1
                dropped = self.dropped_saves
            if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, ... drop: a warning, not a flood
                logger.warning("disk tier: writer behind, %d saves dropped so far", dropped)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except Exception as e:  # a failing disk costs blocks, never the writer thread
                logger.warning("disk tier: save of block %d failed: %s", item[0], e)
            finally:
                with self._lock:
                    self._pending.pop(item[0], None)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: int, data: bytes) -> None:
        header = pack_header(key, data)  # the digest on this thread, not the caller's
        self._unlink(self._make_room(0 if key in self._index else 1))  # known: another process wrote it
        path = self.path_for(key)
        tmp = f"{path}.{os.getpid()}.{next(_temp_seq)}.tmp"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if os.writev(fd, [header, data]) != self.entry_nbytes:
                    raise OSError(f"short write to {tmp}")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self._index[key] = time.time()
            self._index.move_to_end(key)
            self._stats.saves += 1
            self._stats.saved_bytes += self.block_nbytes

    def load(self, key: int, out: memoryview) -> bool:
        dst = _as_bytes(out, self.block_nbytes, "out", writable=True)
        t0 = time.perf_counter()
        try:
            with self._lock:
                data = self._pending.get(key)
                if key in self._index:  # most recently used now: no eviction picks it during the read
                    self._index.move_to_end(key)
            if data is not None:
                dst[:] = np.frombuffer(data, np.uint8)
                self._count(hits=1, loaded_bytes=self.block_nbytes)
                return True
            return self._load_file(key, dst)
        except OSError as e:
            logger.warning("disk tier: load of block %d failed: %s", key, e)
            self._count(misses=1)
            return False
        finally:
            self._count(load_seconds=time.perf_counter() - t0)

    def _load_file(self, key: int, dst: np.ndarray) -> bool:
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # never here, evicted, or removed by another process
            with self._lock:
                self._index.pop(key, None)
                self._stats.misses += 1
            return False
        try:
            st = os.fstat(fd)
            h = EntryHeader.unpack(os.pread(fd, HEADER.size, 0))
            if h is not None and self._expired(h):
                self._drop(key, path, st.st_ino, expired=1)
                return False
            n = os.preadv(fd, [dst], HEADER.size) if st.st_size == self.entry_nbytes else 0
            if h is None or n != self.block_nbytes or not h.verifies(key, memoryview(dst)):
                logger.warning("disk tier: %s did not verify; dropped", path)
                self._drop(key, path, st.st_ino, verify_failures=1)
                return False
            with suppress(OSError):
                os.utime(fd)  # the LRU order, for the next start's scan
            linked = os.fstat(fd).st_nlink > 0  # not evicted or replaced while we read (the data is still good)
        finally:
            os.close(fd)
        with self._lock:
            if linked:
                self._index[key] = time.time()
                self._index.move_to_end(key)
            self._stats.hits += 1
            self._stats.loaded_bytes += self.block_nbytes
        return True

    def _drop(self, key: int, path: str, ino: int, **counts: int) -> None:
        with suppress(FileNotFoundError):
            if os.stat(path).st_ino == ino:  # not if another process has replaced it with a good one since
                os.unlink(path)
        with self._lock:
            self._index.pop(key, None)
        self._count(misses=1, **counts)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)  # after every queued save: close drains
        self._writer.join()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**{**self._stats.__dict__, "used_blocks": len(self._index)})
