"""The host tier: KV blocks in one shared-memory file (/dev/shm) that every worker process on a host maps.

Layout: a 4 KiB file header (geometry), a table of 64-byte slot records (entry header, then last-used
ns), then the payloads at a fixed stride. The table is set-associative: key mod num_buckets picks a
bucket of up to 8 ways, so a lookup reads 512 bytes and LRU is exact within a bucket, approximate
over the store. Locking is fcntl.lockf on the bucket's record range, shared to read and exclusive to
write: it is the pin (a save into a bucket waits for every copy out of it), and the kernel drops it
when its process dies, so a worker killed mid-save cannot wedge a bucket. A save zeroes the slot's
magic first and writes it last, so a torn slot reads as empty (and its digest would not verify).

Opening: each process opens with O_CREAT under an exclusive lock on the header's first byte; a file
that is new, torn, or of another geometry is (re)created (posix_fallocate: a full /dev/shm fails here,
not as a SIGBUS on a later write) only if no open tier holds the shared lock on the second byte,
else it is a ValueError. Open tiers after any fork: record locks are not inherited.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import numpy as np

from tandem.kv.store.tier import HEADER, MAGIC, EntryHeader, KVTier, TierStats, pack_header

logger = logging.getLogger(__name__)

FILE_MAGIC = b"TKVHOST1"  # the layout's version is in the magic
FILE_HEADER = struct.Struct("<8sqqqq")  # magic, ways, block bytes, buckets, file size
PAGE = 4096
RECORD, LAST_USED = 64, 48  # a slot's record: HEADER.size bytes of entry header, int64 last-used ns at 48
MAX_WAYS, STRIPES = 8, 64
INIT_BYTE, HOLDER_BYTE = 0, 1  # lock bytes in the file header page, which no bucket range covers


def default_shm_path(ident: str) -> str:
    """A /dev/shm path every process derives alike from the same id (a model fingerprint, a port)."""
    return f"/dev/shm/tandem-kv-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class Geometry:
    block_nbytes: int
    ways: int
    num_buckets: int

    @classmethod
    def for_capacity(cls, capacity_bytes: int, block_nbytes: int) -> Geometry:
        slots = capacity_bytes // block_nbytes if block_nbytes > 0 else 0
        if slots < 1:
            raise ValueError(f"host tier: {capacity_bytes} bytes hold no block of {block_nbytes} bytes")
        return cls(block_nbytes, min(MAX_WAYS, slots), slots // min(MAX_WAYS, slots))

    @property
    def num_slots(self) -> int:
        return self.ways * self.num_buckets

    @property
    def stride(self) -> int:
        return -(-self.block_nbytes // 64) * 64  # cache-line aligned payloads

    @property
    def data_offset(self) -> int:
        return -(-(PAGE + self.num_slots * RECORD) // PAGE) * PAGE

    @property
    def file_size(self) -> int:
        return self.data_offset + self.num_slots * self.stride

    def pack(self) -> bytes:
        return FILE_HEADER.pack(FILE_MAGIC, self.ways, self.block_nbytes, self.num_buckets, self.file_size)

    @classmethod
    def unpack(cls, raw: bytes) -> Geometry | None:
        magic, ways, block_nbytes, buckets, size = FILE_HEADER.unpack_from(raw.ljust(FILE_HEADER.size, b"\0"))
        g = cls(block_nbytes, ways, buckets)
        return g if magic == FILE_MAGIC and ways > 0 and g.file_size == size else None


def _lock(fd: int, cmd: int, length: int, start: int) -> None:
    # The kernel's deadlock check is per process, so two threads of one process in two buckets can look
    # like a cycle with another process: a false EDEADLK, waited out.
    while True:
        try:
            return fcntl.lockf(fd, cmd, length, start)
        except OSError as e:
            if e.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)


class _Mapping:
    """This process's one descriptor and mapping of a store file, shared by its HostTiers: record locks
    belong to the process, so two descriptors would not exclude each other's threads, and closing
    either would drop the other's locks."""

    def __init__(self, path: str, geometry: Geometry) -> None:
        self.path, self.geometry, self.refs = path, geometry, 0
        self.stripes = [threading.Lock() for _ in range(min(STRIPES, geometry.num_buckets))]
        self.fd = fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(fd, fcntl.LOCK_EX, 1, INIT_BYTE)
            try:
                found = Geometry.unpack(os.pread(fd, FILE_HEADER.size, 0))
                if found != geometry or os.fstat(fd).st_size != geometry.file_size:
                    try:  # nobody else may hold it while it is re-created
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, HOLDER_BYTE)
                    except OSError as e:
                        if e.errno not in (errno.EAGAIN, errno.EACCES):
                            raise
                        raise ValueError(f"{path} is in use with {found}, not {geometry}") from None
                    if found is not None:
                        logger.warning("host tier: re-creating %s (%s -> %s)", path, found, geometry)
                    os.ftruncate(fd, 0)  # drops every old page: nothing stale survives
                    os.posix_fallocate(fd, 0, geometry.file_size)
                    os.pwrite(fd, geometry.pack(), 0)
                _lock(fd, fcntl.LOCK_SH, 1, HOLDER_BYTE)  # held until close: "this file is in use"
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, INIT_BYTE)
            self.ino = os.fstat(fd).st_ino
            self.mm = mmap.mmap(fd, geometry.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise


_mappings: dict[str, _Mapping] = {}
_mappings_lock = threading.Lock()


def _acquire(path: str, geometry: Geometry) -> _Mapping:
    path = os.path.realpath(path)
    with _mappings_lock:
        m = _mappings.get(path)
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            ino = None
        if m is None or m.ino != ino:  # first tier here, or the file was unlinked and made anew
            m = _mappings[path] = _Mapping(path, geometry)
        elif m.geometry != geometry:
            raise ValueError(f"{path} is in use with {m.geometry}, not {geometry}")
        m.refs += 1
        return m


def _release(m: _Mapping) -> None:
    with _mappings_lock:
        m.refs -= 1
        if m.refs == 0:
            if _mappings.get(m.path) is m:
                del _mappings[m.path]
            m.mm.close()
            os.close(m.fd)  # drops this process's locks on the file


def _as_bytes(buf: memoryview | bytes, nbytes: int, what: str, writable: bool = False) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.size != nbytes or (writable and not arr.flags.writeable):
        raise ValueError(f"{what} is {arr.size} bytes{'' if arr.flags.writeable else ', read-only'}; "
                         f"the tier's blocks are {nbytes}")
    return arr


class HostTier(KVTier):
    """Counters in stats() are this process's; used_blocks and capacity_blocks are the shared file's."""

    name = "host"

    def __init__(self, path: str, capacity_bytes: int, block_nbytes: int, ttl_s: float | None = None) -> None:
        self.path, self.block_nbytes, self.ttl_s = path, block_nbytes, ttl_s
        self.geometry = g = Geometry.for_capacity(capacity_bytes, block_nbytes)
        self._map = _acquire(path, g)
        mm, n = self._map.mm, g.num_slots
        self._records = np.frombuffer(mm, np.uint8, n * RECORD, PAGE).reshape(n, RECORD)
        self._last_used = np.ndarray((n,), np.int64, mm, PAGE + LAST_USED, (RECORD,))
        self._data = np.frombuffer(mm, np.uint8, n * g.stride, g.data_offset).reshape(n, g.stride)[:, :block_nbytes]
        self._stats = TierStats(capacity_blocks=n)
        self._lock = threading.Lock()  # the counters and the tick
        self._tick_ns = 0
        self._closed = False

    default_path = staticmethod(default_shm_path)

    # Test hook: every payload copy, in (under the bucket's exclusive lock) and out (under the shared one).
    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    @contextmanager
    def _bucket(self, key: int, exclusive: bool) -> Iterator[range]:
        g = self.geometry
        b = key % g.num_buckets
        start, length = PAGE + b * g.ways * RECORD, g.ways * RECORD
        # Threads of this process take a stripe lock first: to the kernel they are one lock owner.
        with self._map.stripes[b % len(self._map.stripes)]:
            _lock(self._map.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, length, start)
            try:
                yield range(b * g.ways, (b + 1) * g.ways)
            finally:
                fcntl.lockf(self._map.fd, fcntl.LOCK_UN, length, start)

    def _header(self, slot: int) -> EntryHeader | None:
        return EntryHeader.unpack(self._records[slot, :HEADER.size].tobytes())

    def _find(self, slots: range, key: int) -> tuple[int, EntryHeader] | None:
        return next(((s, h) for s in slots if (h := self._header(s)) is not None and h.key == key), None)

    def _expired(self, h: EntryHeader) -> bool:
        return self.ttl_s is not None and time.time() - h.stored_at > self.ttl_s

    def _touch(self, slot: int) -> None:
        # Also stored under a shared lock: racing readers each write one aligned int64 of "about now",
        # all LRU needs. Strictly increasing within a process, so one process's order is exact.
        with self._lock:
            self._tick_ns = max(time.time_ns(), self._tick_ns + 1)
            self._last_used[slot] = self._tick_ns

    def _drop(self, key: int, slot: int, seen: EntryHeader) -> None:
        """Empty a slot found bad under the shared lock, unless a writer has replaced it since."""
        with self._bucket(key, exclusive=True):
            if self._header(slot) == seen:
                self._records[slot, :4] = 0

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for field, d in deltas.items():
                setattr(self._stats, field, getattr(self._stats, field) + d)

    def contains(self, key: int) -> bool:
        try:
            with self._bucket(key, exclusive=False) as slots:
                found = self._find(slots, key)
        except OSError as e:
            logger.warning("host tier: lookup failed: %s", e)
            found = None
        if found is None or self._expired(found[1]):
            self._count(misses=1)  # a lookup that found nothing usable (the load that follows a True counts)
            return False
        return True

    def load(self, key: int, out: memoryview) -> bool:
        dst = _as_bytes(out, self.block_nbytes, "out", writable=True)
        t0 = time.perf_counter()
        try:
            with self._bucket(key, exclusive=False) as slots:
                found = self._find(slots, key)
                if found is not None and not self._expired(found[1]):
                    self._copy(dst, self._data[found[0]])
                    self._touch(found[0])
            if found is None:
                self._count(misses=1)
            elif self._expired(found[1]):
                self._drop(key, *found)
                self._count(misses=1, expired=1)
            elif not found[1].verifies(key, memoryview(dst)):  # our own copy, checked outside the lock
                self._drop(key, *found)
                logger.warning("host tier: block %d did not verify; dropped", key)
                self._count(misses=1, verify_failures=1)
            else:
                self._count(hits=1, loaded_bytes=self.block_nbytes)
                return True
        except OSError as e:
            logger.warning("host tier: load failed: %s", e)
            self._count(misses=1)
        finally:
            self._count(load_seconds=time.perf_counter() - t0)
        return False

    def save(self, key: int, payload: memoryview) -> None:
        src = _as_bytes(payload, self.block_nbytes, "payload")
        header = np.frombuffer(pack_header(key, memoryview(src)), np.uint8)  # the digest, outside the lock
        try:
            with self._bucket(key, exclusive=True) as slots:
                found = self._find(slots, key)
                if found is not None and not self._expired(found[1]):
                    self._touch(found[0])
                    return

                def rank(s: int) -> tuple[int, int]:  # empty first, then expired, then least recently used
                    h = self._header(s)
                    return (0 if h is None else 1 if self._expired(h) else 2), int(self._last_used[s])

                slot = found[0] if found is not None else min(slots, key=rank)
                gone = ("", "expired", "evictions")[rank(slot)[0]]
                self._records[slot, :4] = 0  # a torn write never reads as an entry: the magic goes in last
                self._copy(self._data[slot], src)
                self._records[slot, 4:HEADER.size] = header[4:]
                self._touch(slot)
                self._records[slot, :4] = header[:4]
        except OSError as e:
            logger.warning("host tier: save failed: %s", e)
            return
        self._count(saves=1, saved_bytes=self.block_nbytes, **({gone: 1} if gone else {}))

    def stats(self) -> TierStats:
        used = 0 if self._closed else int((self._records[:, :4] == np.frombuffer(MAGIC, np.uint8)).all(1).sum())
        with self._lock:
            return TierStats(**{**self._stats.__dict__, "used_blocks": used})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            del self._records, self._last_used, self._data  # the views first, or the mapping cannot close
            _release(self._map)

    def unlink(self) -> None:
        """Remove the file (processes that have it mapped keep their mapping until they close)."""
        with suppress(FileNotFoundError):
            os.unlink(self.path)
