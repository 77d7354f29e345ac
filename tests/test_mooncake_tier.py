"""The Mooncake Store tier against a real master on loopback: round trips over TCP, misses, corrupt and
expired entries, and a second client in another process. Skipped, with the reason, where Mooncake
(the optional `mooncake` extra, and libibverbs on Debian) is not installed."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from multiprocessing.connection import Connection

import numpy as np
import pytest

from tandem.kv.store.mooncake_master import mooncake_available, start_local_master, stop_local_master
from tandem.kv.store.mooncake_tier import MooncakeTier, parse_url
from tandem.kv.store.tier import HEADER, pack_header

BLOCK = 64 * 1024
SEGMENT = 32 << 20
BUFFER = 8 << 20


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def load(tier: MooncakeTier, key: int) -> np.ndarray | None:
    out = np.zeros(tier.block_nbytes, np.uint8)
    return out if tier.load(key, memoryview(out)) else None


@pytest.fixture(scope="module")
def master_url() -> Iterator[str]:
    reason = mooncake_available()
    if reason is not None:
        pytest.skip(f"Mooncake is not usable here: {reason}")
    proc, url = start_local_master()
    try:
        yield url
    finally:
        stop_local_master(proc)


@pytest.fixture
def make_tier(master_url: str) -> Iterator[Callable[..., MooncakeTier]]:
    """Tiers on the shared master, each test in its own key namespace."""
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    tiers: list[MooncakeTier] = []

    def make(block_nbytes: int = BLOCK, ttl_s: float | None = None) -> MooncakeTier:
        tier = MooncakeTier(master_url, block_nbytes, ttl_s=ttl_s, global_segment_size=SEGMENT,
                            local_buffer_size=BUFFER, namespace=namespace)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()  # a second or two each (Mooncake's close holds the GIL meanwhile)


def test_url_parsing() -> None:  # needs no Mooncake
    assert parse_url("mooncake://127.0.0.1:50051") == ("127.0.0.1", 50051, {})
    assert parse_url("mooncake://h:1?segment_mib=64&metadata=P2PHANDSHAKE") == (
        "h", 1, {"segment_mib": "64", "metadata": "P2PHANDSHAKE"})
    for bad in ("redis://h:1", "mooncake://h", "mooncake://:1", "mooncake://h:1?colour=red"):
        with pytest.raises(ValueError):
            parse_url(bad)
    assert mooncake_available() is None or isinstance(mooncake_available(), str)


def test_round_trip_over_tcp_and_stats(make_tier: Callable[..., MooncakeTier]) -> None:
    big = 737_280  # a real block: 16 tokens of a small model's KV, every layer
    tier = make_tier(block_nbytes=big)
    assert tier.local_hostname == "127.0.0.1" and tier.mooncake_key(-1) == f"{tier.namespace}/{'f' * 16}"
    tier.save(-7, memoryview(block(1, big)))
    tier.save(2**62, memoryview(block(2, big)))
    tier.flush()
    assert tier.contains(-7) and tier.contains(2**62) and not tier.contains(5)
    assert np.array_equal(load(tier, -7), block(1, big)) and np.array_equal(load(tier, 2**62), block(2, big))
    tier.save(-7, memoryview(block(3, big)))  # already here: only touched
    assert np.array_equal(load(tier, -7), block(1, big))
    s = tier.stats()
    assert (s.hits, s.misses, s.saves, s.saved_bytes, s.loaded_bytes) == (3, 0, 2, 2 * big, 3 * big)
    assert (s.used_blocks, s.capacity_blocks, s.verify_failures, s.expired) == (2, SEGMENT // (HEADER.size + big), 0, 0)
    assert s.load_seconds > 0
    with pytest.raises(ValueError):
        tier.save(1, memoryview(bytes(big - 1)))
    with pytest.raises(ValueError):
        tier.load(1, memoryview(bytearray(big + 1)))
    with pytest.raises(ValueError):
        tier.load(-7, memoryview(bytes(big)))  # read-only


def test_miss(make_tier: Callable[..., MooncakeTier]) -> None:
    tier = make_tier()
    out = np.full(BLOCK, 7, np.uint8)
    assert not tier.load(12345, memoryview(out)) and not tier.contains(12345)
    assert (out == 7).all()  # a miss leaves the buffer alone
    s = tier.stats()
    assert (s.hits, s.misses, s.verify_failures, s.expired) == (0, 1, 0, 0)


def test_corrupt_entries_are_dropped_counted_and_removed(make_tier: Callable[..., MooncakeTier]) -> None:
    tier = make_tier()
    client = tier._client
    payload = block(1)
    # a header that does not match the payload (the digest of another block), one under another key,
    # a torn entry, and bytes that are no entry at all: each put under the key by the client directly
    bad = {
        1: pack_header(1, block(2)) + payload.tobytes(),
        2: pack_header(99, payload) + payload.tobytes(),
        3: (pack_header(3, payload) + payload.tobytes())[: HEADER.size + BLOCK // 2],
        4: b"not a block",
    }
    for key, raw in bad.items():
        assert client.put(tier.mooncake_key(key), raw) == 0
        assert tier.contains(key)
    for key in bad:
        assert load(tier, key) is None
        assert not tier.contains(key), "a corrupt entry must be removed"
        assert client.is_exist(tier.mooncake_key(key)) == 0
    s = tier.stats()
    assert (s.verify_failures, s.misses, s.hits) == (4, 4, 0)
    # the key is usable again: a good save after the bad one loads
    tier.save(1, memoryview(payload))
    assert np.array_equal(load(tier, 1), payload)


def test_ttl_expiry(make_tier: Callable[..., MooncakeTier]) -> None:
    tier = make_tier(ttl_s=30.0)
    old, fresh = block(1), block(2)
    assert tier._client.put(tier.mooncake_key(1), pack_header(1, old, stored_at=time.time() - 31) + old.tobytes()) == 0
    tier.save(2, memoryview(fresh))
    assert load(tier, 1) is None and not tier.contains(1)
    assert np.array_equal(load(tier, 2), fresh)
    s = tier.stats()
    assert (s.expired, s.verify_failures, s.hits, s.misses) == (1, 0, 1, 1)


def test_threads(make_tier: Callable[..., MooncakeTier]) -> None:
    tier = make_tier()
    wrong: list[int] = []

    def run(seed: int) -> None:
        for key in np.random.default_rng(seed).integers(0, 16, 60):
            got = load(tier, int(key))
            if got is None:
                tier.save(int(key), memoryview(block(int(key))))
            elif not np.array_equal(got, block(int(key))):
                wrong.append(int(key))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not wrong and tier.stats().hits > 0


def test_closed_tier_is_a_miss_and_saves_nothing(make_tier: Callable[..., MooncakeTier]) -> None:
    tier = make_tier()
    tier.save(1, memoryview(block(1)))
    tier.close()
    tier.close()
    assert load(tier, 1) is None and not tier.contains(1)
    tier.save(2, memoryview(block(2)))  # does not raise


def test_unreachable_master_fails_fast(master_url: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        MooncakeTier(f"mooncake://127.0.0.1:{port}", BLOCK, connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 5


def _client(conn: Connection, url: str, namespace: str) -> None:  # a spawned process: another client
    tier = MooncakeTier(url, BLOCK, global_segment_size=SEGMENT, local_buffer_size=BUFFER, namespace=namespace)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        op, key = cmd
        if op == "load":
            got = load(tier, key)
            conn.send(None if got is None else got.tobytes())
        else:
            tier.save(key, memoryview(block(key)))
            conn.send("saved")
    tier.close()


def test_another_process_loads_what_this_one_saved(make_tier: Callable[..., MooncakeTier], master_url: str) -> None:
    tier = make_tier()
    for key in range(4):
        tier.save(key, memoryview(block(key)))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_client, args=(child, master_url, tier.namespace), daemon=True)
    proc.start()

    def ask(*cmd: object) -> object:
        conn.send(cmd)
        assert conn.poll(30), "the other client did not answer"
        return conn.recv()

    try:
        assert conn.poll(60) and conn.recv() == "ready"
        for key in range(4):
            assert ask("load", key) == block(key).tobytes()
        assert ask("load", 99) is None
        # and the other way: what the other process saves (wherever the master placed it) loads here,
        # while that process, whose segment may hold it, is alive
        assert ask("save", 10) == "saved"
        assert np.array_equal(load(tier, 10), block(10))
    finally:
        with suppress(OSError):
            conn.send(None)
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
