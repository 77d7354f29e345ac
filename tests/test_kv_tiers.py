"""The host (shared memory) and disk tiers of the KV store: round trips, LRU, TTL, integrity, pins, and
what other processes (and killed ones) see."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

WORKER_ENV = "TANDEM_KV_TIER_TEST_WORKER"
if os.environ.get(WORKER_ENV) and "tandem" not in sys.modules:
    # A spawned worker: the tiers need only numpy, so skip tandem/__init__ (torch: seconds a process).
    sys.modules["tandem"] = types.ModuleType("tandem")
    sys.modules["tandem"].__path__ = [str(Path(__file__).resolve().parents[1] / "tandem")]

from tandem.kv.store.disk_tier import DiskTier  # noqa: E402
from tandem.kv.store.host_tier import HostTier, default_shm_path  # noqa: E402
from tandem.kv.store.tier import HEADER, MAGIC, KVTier  # noqa: E402

BLOCK = 4096


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def load(tier: KVTier, key: int) -> np.ndarray | None:
    out = np.zeros(BLOCK, np.uint8)
    return out if tier.load(key, memoryview(out)) else None


def present(tier: KVTier, keys: range) -> set[int]:
    return {k for k in keys if load(tier, k) is not None}


def _serve(conn: Connection, path: str, capacity: int) -> None:  # a spawned worker process: saves on command
    tier = HostTier(path, capacity, BLOCK)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        op, key, seed = cmd
        if op == "half":  # copy half the payload under the bucket's lock, then hang until killed

            def half(dst: np.ndarray, src: np.ndarray) -> None:
                dst[: BLOCK // 2] = src[: BLOCK // 2]
                conn.send("half")
                time.sleep(60)

            tier._copy = half
        tier.save(key, memoryview(block(seed)))
        conn.send("saved")
    tier.close()


class Worker:
    def __init__(self, path: str, capacity: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, path, capacity), daemon=True)
        os.environ[WORKER_ENV] = "1"  # the child's environment is this one, at start
        try:
            self.proc.start()
        finally:
            del os.environ[WORKER_ENV]
        assert self.recv() == "ready"

    def recv(self, timeout: float = 30.0) -> str:
        assert self.conn.poll(timeout), "worker did not answer"
        return self.conn.recv()

    def stop(self) -> None:
        with suppress(OSError):
            self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


class Opened:
    """What a test opens (tiers on one shm file and one directory, workers), closed at its end."""

    def __init__(self, shm_path: str, tmp_path: Path) -> None:
        self.shm_path, self.dir, self.things = shm_path, tmp_path, []

    def host(self, blocks: int = 8, ttl_s: float | None = None, block_nbytes: int = BLOCK) -> HostTier:
        self.things.append(HostTier(self.shm_path, blocks * BLOCK, block_nbytes, ttl_s))
        return self.things[-1]

    def disk(self, blocks: int = 8, ttl_s: float | None = None, sub: str = "kv", queue_depth: int = 64) -> DiskTier:
        self.things.append(DiskTier(str(self.dir / sub), blocks * (HEADER.size + BLOCK), BLOCK, ttl_s, queue_depth))
        return self.things[-1]

    def worker(self, blocks: int) -> Worker:
        self.things.append(Worker(self.shm_path, blocks * BLOCK))
        return self.things[-1]


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Opened]:
    o = Opened(default_shm_path(f"test-{os.getpid()}-{uuid.uuid4()}"), tmp_path)
    yield o
    for t in reversed(o.things):
        t.stop() if isinstance(t, Worker) else t.close()
    with suppress(FileNotFoundError):
        os.unlink(o.shm_path)


@pytest.fixture(params=["host", "disk"])
def make_tier(request: pytest.FixtureRequest, opened: Opened) -> Callable[..., KVTier]:
    return getattr(opened, request.param)


def test_round_trip_miss_and_stats(make_tier: Callable[..., KVTier]) -> None:
    tier = make_tier()
    tier.save(-7, memoryview(block(1)))
    tier.save(2**62, memoryview(block(2)))
    tier.flush()
    assert tier.contains(-7) and not tier.contains(5)
    assert np.array_equal(load(tier, -7), block(1)) and np.array_equal(load(tier, 2**62), block(2))
    assert load(tier, 5) is None
    tier.save(-7, memoryview(block(3)))  # already here: only touched
    tier.flush()
    assert np.array_equal(load(tier, -7), block(1))
    s = tier.stats()
    assert (s.hits, s.misses, s.saves, s.saved_bytes, s.loaded_bytes) == (3, 2, 2, 2 * BLOCK, 3 * BLOCK)
    assert (s.used_blocks, s.capacity_blocks, s.evictions, s.verify_failures, s.expired) == (2, 8, 0, 0, 0)
    assert s.load_seconds > 0
    with pytest.raises(ValueError):
        tier.save(1, memoryview(bytes(BLOCK - 1)))
    with pytest.raises(ValueError):
        tier.load(1, memoryview(bytearray(BLOCK + 1)))
    with pytest.raises(ValueError):
        tier.load(-7, memoryview(bytes(BLOCK)))  # read-only


def test_concurrent_threads_never_see_wrong_data(make_tier: Callable[..., KVTier]) -> None:
    tier = make_tier(4)
    wrong: list[int] = []

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for key in rng.integers(0, 12, 150):
            got = load(tier, int(key))
            if got is None:
                tier.save(int(key), memoryview(block(int(key))))
            elif not np.array_equal(got, block(int(key))):
                wrong.append(int(key))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, range(4)))
    tier.flush()
    assert not wrong and tier.stats().verify_failures == 0 and tier.stats().used_blocks <= 4


def test_lru_evicts_least_recently_used(make_tier: Callable[..., KVTier]) -> None:
    tier = make_tier(4)
    for k in range(4):
        tier.save(k, memoryview(block(k)))
        tier.flush()
    assert load(tier, 0) is not None  # 1 is now the least recently used
    tier.save(4, memoryview(block(4)))
    tier.flush()
    tier.save(2, memoryview(block(2)))  # a save of a present key touches it: 3 is next
    tier.save(5, memoryview(block(5)))
    tier.flush()
    assert present(tier, range(6)) == {0, 2, 4, 5} and tier.stats().evictions == 2 and tier.stats().used_blocks == 4


def test_ttl_expiry(make_tier: Callable[..., KVTier]) -> None:
    tier = make_tier(ttl_s=0.2)
    tier.save(1, memoryview(block(1)))
    tier.flush()
    assert load(tier, 1) is not None
    time.sleep(0.3)
    assert load(tier, 1) is None and load(tier, 1) is None  # expired, then gone
    s = tier.stats()
    assert (s.expired, s.misses, s.used_blocks) == (1, 2, 0)
    tier.save(1, memoryview(block(2)))  # stored afresh
    tier.flush()
    assert np.array_equal(load(tier, 1), block(2))


def _patch_shm(path: str, find: bytes, offset: int, data: bytes) -> None:
    """Write into the shared store through the file, as a stray writer would (same pages as the mappings)."""
    with open(path, "r+b") as f:
        at = f.read().find(find)
        assert at >= 0
        f.seek(at + offset)
        f.write(data)


def test_host_corrupt_payload_and_wrong_key_are_dropped(opened: Opened) -> None:
    tier = opened.host()
    for k in (1, 2, 3):
        tier.save(k, memoryview(block(k)))
    _patch_shm(opened.shm_path, block(1).tobytes(), 100, bytes([block(1)[100] ^ 0xFF]))
    assert load(tier, 1) is None and tier.stats().verify_failures == 1
    assert not tier.contains(1) and tier.stats().used_blocks == 2  # gone
    _patch_shm(opened.shm_path, MAGIC + struct.pack("<q", 2), 4, struct.pack("<q", 9))  # entry 2 claims key 9
    assert load(tier, 9) is None and tier.stats().verify_failures == 2
    assert np.array_equal(load(tier, 3), block(3))


def test_disk_corrupt_payload_and_wrong_key_are_dropped(opened: Opened) -> None:
    tier = opened.disk()
    for k in (1, 2, 3):
        tier.save(k, memoryview(block(k)))
    tier.flush()
    with open(tier.path_for(1), "r+b") as f:
        f.seek(HEADER.size + 100)
        f.write(bytes([block(1)[100] ^ 0xFF]))
    assert load(tier, 1) is None and tier.stats().verify_failures == 1
    assert not os.path.exists(tier.path_for(1)) and not tier.contains(1)
    shutil.copy(tier.path_for(2), tier.path_for(3))  # 3's file holds 2's entry
    assert load(tier, 3) is None and tier.stats().verify_failures == 2
    assert np.array_equal(load(tier, 2), block(2))


def test_host_saved_by_another_process_and_pinned_across_processes(opened: Opened) -> None:
    worker, tier = opened.worker(8), opened.host(8)
    worker.conn.send(("save", 42, 7))
    assert worker.recv() == "saved"
    assert tier.contains(42) and np.array_equal(load(tier, 42), block(7))
    # While this process copies block 42 out, the worker's save to the same bucket (there is one) waits,
    # and so does a save from another thread here.
    gate, entered, copy = threading.Event(), threading.Event(), tier._copy

    def slow_copy(dst: np.ndarray, src: np.ndarray) -> None:
        if not entered.is_set():
            entered.set()
            assert gate.wait(10)
        copy(dst, src)

    tier._copy = slow_copy
    loaded: list[np.ndarray | None] = []
    loader = threading.Thread(target=lambda: loaded.append(load(tier, 42)))
    loader.start()
    assert entered.wait(5)
    saver = threading.Thread(target=tier.save, args=(43, memoryview(block(8))))
    saver.start()
    worker.conn.send(("save", 44, 9))
    time.sleep(0.5)
    assert saver.is_alive() and not worker.conn.poll(0), "a save did not wait for the pinned load"
    gate.set()
    loader.join(5)
    saver.join(5)
    assert worker.recv() == "saved" and np.array_equal(loaded[0], block(7))
    assert np.array_equal(load(tier, 43), block(8)) and np.array_equal(load(tier, 44), block(9))


def test_host_writer_killed_mid_save_leaves_store_consistent(opened: Opened) -> None:
    tier = opened.host(2)  # one bucket of two ways
    tier.save(10, memoryview(block(10)))
    tier.save(11, memoryview(block(11)))
    assert load(tier, 11) is not None  # 10 is the one the worker's save replaces
    worker = opened.worker(2)
    worker.conn.send(("half", 12, 12))
    assert worker.recv() == "half"
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.join(5)
    assert tier.stats().used_blocks == 1  # the torn slot reads as empty, not as an entry to verify
    assert load(tier, 12) is None and load(tier, 10) is None and tier.stats().verify_failures == 0
    assert np.array_equal(load(tier, 11), block(11))
    saver = threading.Thread(target=tier.save, args=(12, memoryview(block(12))))
    saver.start()
    saver.join(5)
    assert not saver.is_alive(), "the dead writer's bucket lock was not released"
    assert np.array_equal(load(tier, 12), block(12))


def test_host_geometry_mismatch(opened: Opened) -> None:
    tier = opened.host(8)
    with pytest.raises(ValueError, match="in use"):
        opened.host(8, block_nbytes=2 * BLOCK)
    tier.save(1, memoryview(block(1)))
    assert np.array_equal(load(opened.host(8), 1), block(1))  # a second tier here shares the mapping
    for t in opened.things:
        t.close()
    other = opened.host(4)  # nobody holds it: re-created, empty
    assert other.stats().capacity_blocks == 4 and load(other, 1) is None
    other.close()
    other.unlink()
    assert not os.path.exists(opened.shm_path)


def test_disk_restart_and_other_processes(opened: Opened) -> None:
    tier = opened.disk(3)
    for k in range(3):
        tier.save(k, memoryview(block(k)))
        tier.flush()
        time.sleep(0.02)  # file times are coarse
    assert load(tier, 0) is not None  # its mtime moves: 1 is the oldest on disk
    tier.close()
    restarted = opened.disk(3)
    assert restarted.stats().used_blocks == 3
    restarted.save(3, memoryview(block(3)))
    restarted.flush()
    assert present(restarted, range(4)) == {0, 2, 3}
    beside, writer = opened.disk(3, sub="shared"), opened.disk(3, sub="shared")  # as another process would
    writer.save(99, memoryview(block(99)))
    writer.flush()
    assert beside.contains(99) and np.array_equal(load(beside, 99), block(99))
    os.unlink(writer.path_for(99))  # vanished under us: a miss, not an error
    assert load(beside, 99) is None and beside.stats().verify_failures == 0


def test_disk_cleans_temp_files_of_dead_writers(opened: Opened) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    sub = opened.dir / "kv" / "00"
    sub.mkdir(parents=True)
    (sub / f"0000000000000001.kv.{dead.pid}.0.tmp").write_bytes(b"torn")
    live = sub / f"0000000000000002.kv.{os.getppid()}.0.tmp"  # a live process may still be writing it
    live.write_bytes(b"in flight")
    (sub / "0000000000000003.kv").write_bytes(b"short")  # not a block of this size
    assert opened.disk(4).stats().used_blocks == 0
    assert [p.name for p in sub.iterdir()] == [live.name]


def test_disk_capacity_bound_and_full_queue(opened: Opened) -> None:
    tier = opened.disk(5)
    for k in range(40):
        tier.save(k, memoryview(block(k)))
    tier.flush()
    files = list((opened.dir / "kv").rglob("*.kv"))
    assert len(files) == 5 and sum(f.stat().st_size for f in files) <= 5 * (HEADER.size + BLOCK)
    s = tier.stats()
    assert (s.saves, s.evictions, s.used_blocks) == (40, 35, 5)
    assert present(tier, range(40)) == set(range(35, 40))
    slow = opened.disk(5, sub="slow", queue_depth=1)
    gate, write = threading.Event(), slow._write

    def stalled(key: int, data: bytes) -> None:
        assert gate.wait(10)
        write(key, data)

    slow._write = stalled
    slow.save(1, memoryview(block(1)))
    deadline = time.monotonic() + 5
    while slow._queue.qsize() and time.monotonic() < deadline:  # until the writer has taken it
        time.sleep(0.01)
    slow.save(2, memoryview(block(2)))  # queued
    slow.save(3, memoryview(block(3)))  # queue full: dropped
    assert np.array_equal(load(slow, 2), block(2))  # served before it is written
    gate.set()
    slow.flush()
    assert slow.dropped_saves == 1 and slow.stats().saves == 2 and present(slow, range(4)) == {1, 2}
