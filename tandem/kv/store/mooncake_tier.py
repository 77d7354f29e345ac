"""The distributed tier of the KV store: Mooncake Store (kvcache-ai/Mooncake) over TCP.

A Mooncake deployment is one master (``mooncake_master``: object placement, leases, eviction) and any
number of clients; each client lends the pool a segment of its own memory (``global_segment_size``)
and every block is stored in some client's segment, whichever the master picks, and read over the
transfer engine (TCP here). So a block saved by one process is loadable by every process and host
that talks to the same master, for as long as the client whose segment holds it is alive: closing a
tier (or its process dying) takes its segment, and the blocks in it, out of the pool.

Each entry is ``pack_header(key, payload) + payload`` under the string key ``f"{namespace}/{key:016x}"``
(the unsigned 64-bit key in hex). A load that does not verify is removed and counted, exactly like
the local tiers; so is one older than the time to live.

Capacity and eviction are Mooncake's own: the master evicts (approximately LRU) when the pool passes
its high watermark, and a put that finds no room fails until it has. ``capacity_blocks`` is this
process's segment over the entry size, ``used_blocks`` an estimate: what this process stored minus
what it removed, clamped to ``[0, capacity_blocks]`` (it does not see other processes' entries, nor
Mooncake's evictions); ``evictions`` stays 0 for the same reason.

Mooncake's optional: ``pip install 'tandem[mooncake]'`` (the CPU wheel
``mooncake-transfer-engine-non-cuda``), and on Debian ``apt-get install libibverbs1`` (its binaries
link libibverbs even when only TCP is used). ``mooncake_master.mooncake_available()`` says why it cannot be used.

Binding: the master that ``mooncake_master.start_local_master`` starts listens on 127.0.0.1 only (RPC and the
metrics/admin port; no HTTP metadata server: clients use ``P2PHANDSHAKE``). A client advertises
``local_hostname`` (127.0.0.1 for a loopback master) and every connection it makes goes there, but
in this Mooncake version (0.3.13) the client's transfer-engine listeners (the P2P handshake port
and the TCP data port, picked at random) bind the wildcard address, hard-coded, with no setting to
change it; firewall those ports (the range is ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``) where that
matters.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from urllib.parse import parse_qs, urlsplit

import numpy as np

from tandem.kv.store.mooncake_master import accepts, import_store
from tandem.kv.store.tier import HEADER, EntryHeader, KVTier, TierStats, pack_header

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_SEGMENT_BYTES = 256 * MIB
DEFAULT_LOCAL_BUFFER_BYTES = 64 * MIB
MIN_SEGMENT_BYTES = 16 * MIB  # setup refuses a smaller segment ("Total size must be at least 16777216")
P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's error codes (mooncake-store/include/types.h) that this tier tells apart.
_OBJECT_NOT_FOUND = -704
_INVALID_PARAMS = -600  # also what get_into answers for an object larger than the buffer
_ERRORS = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE (store full)",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1700: "TENANT_QUOTA_EXCEEDED",
}


def _error(rc: int) -> str:
    return f"{rc} ({_ERRORS.get(rc, 'error')})"


_URL_OPTIONS = {"segment_mib", "buffer_mib", "metadata", "local_hostname", "protocol", "namespace"}


def parse_url(url: str) -> tuple[str, int, dict[str, str]]:
    """``mooncake://HOST:PORT[?option=value&...]`` -> (host, port, options)."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
        raise ValueError(f"not a Mooncake master URL (mooncake://HOST:PORT): {url!r}")
    options = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(options) - _URL_OPTIONS
    if unknown:
        raise ValueError(f"unknown option(s) in {url!r}: {sorted(unknown)} (known: {sorted(_URL_OPTIONS)})")
    return parts.hostname, parts.port, options


def _local_address_towards(host: str, port: int) -> str:
    """The address this host reaches host from (what peers must connect back to)."""
    try:
        if _is_loopback(host):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks a route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _WarnOnce:
    """Log a failure at most once a minute per kind, with how many were not logged."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last, quiet = self._last.get(kind, (-1e18, 0))
        if now - last >= self.interval_s:
            log.warning("%s%s", message, f" ({quiet} more like it not logged)" if quiet else "")
            self._last[kind] = (now, 0)
        else:
            self._last[kind] = (last, quiet + 1)


class MooncakeTier(KVTier):
    """Blocks in a Mooncake Store pool, by key, verified on load. Thread-safe: one lock around the
    client (and the registered buffer loads land in)."""

    name = "mooncake"

    def __init__(self, url: str, block_nbytes: int, *, ttl_s: float | None = None, local_hostname: str | None = None,
                 metadata_server: str | None = None, global_segment_size: int | None = None,
                 local_buffer_size: int | None = None, protocol: str | None = None, rdma_devices: str = "",
                 namespace: str | None = None, connect_timeout_s: float = 5.0) -> None:
        """url: ``mooncake://HOST:PORT`` of the master, optionally with ``?segment_mib=&buffer_mib=&metadata=
        &local_hostname=&protocol=&namespace=`` (a keyword given here wins over the URL). global_segment_size:
        the memory this process lends the pool (default 256 MiB); local_buffer_size: the client's staging
        buffer (default 64 MiB); metadata_server: ``P2PHANDSHAKE`` (default) or a metadata URL.
        ConnectionError when the master does not answer; RuntimeError when Mooncake is not usable or
        its setup fails."""
        host, port, options = parse_url(url)
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be positive, not {block_nbytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, not {ttl_s}")
        self.url = url
        self.master = f"{host}:{port}"
        self.block_nbytes = block_nbytes
        self.entry_nbytes = HEADER.size + block_nbytes
        self.ttl_s = ttl_s
        self.namespace = namespace or options.get("namespace") or "tandem"
        self.local_hostname = local_hostname or options.get("local_hostname") or _local_address_towards(host, port)
        self.metadata_server = metadata_server or options.get("metadata") or P2PHANDSHAKE
        self.protocol = protocol or options.get("protocol") or "tcp"
        if global_segment_size is None:
            global_segment_size = int(float(options["segment_mib"]) * MIB) if "segment_mib" in options \
                else DEFAULT_SEGMENT_BYTES
        if local_buffer_size is None:
            local_buffer_size = int(float(options["buffer_mib"]) * MIB) if "buffer_mib" in options \
                else DEFAULT_LOCAL_BUFFER_BYTES
        if global_segment_size != 0 and global_segment_size < MIN_SEGMENT_BYTES:
            raise ValueError(f"global_segment_size must be 0 (lend no memory) or at least {MIN_SEGMENT_BYTES} "
                             f"(Mooncake's minimum), not {global_segment_size}")
        if local_buffer_size < self.entry_nbytes:
            raise ValueError(f"local_buffer_size ({local_buffer_size}) is smaller than one entry ({self.entry_nbytes})")
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size

        store = import_store()
        # Setting up against a master that is not there retries for about 90 s: fail fast instead.
        if not accepts(host, port, connect_timeout_s):
            raise ConnectionError(f"the Mooncake master at {self.master} does not accept connections")
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines are many; an explicit setting wins
        self._lock = threading.Lock()
        self._warn = _WarnOnce()
        self._stats = TierStats(capacity_blocks=global_segment_size // self.entry_nbytes)
        self._stored = 0
        self._closed = False
        self._client = store.MooncakeDistributedStore()
        rc = self._client.setup(self.local_hostname, self.metadata_server, global_segment_size, local_buffer_size,
                                self.protocol, rdma_devices, self.master)
        if rc != 0:
            self._closed = True
            with contextlib.suppress(Exception):
                self._client.close()
            raise RuntimeError(f"Mooncake setup against {self.master} failed: {_error(rc)}")
        # Loads land in one registered buffer (get_into: no bytes object per load); get() if it cannot be.
        self._buf = np.empty(self.entry_nbytes, np.uint8)
        self._buf_ptr: int | None = self._buf.ctypes.data
        rc = self._client.register_buffer(self._buf_ptr, self.entry_nbytes)
        if rc != 0:
            log.warning("Mooncake: registering the load buffer failed (%s); loads copy through get()", _error(rc))
            self._buf_ptr = None

    def mooncake_key(self, key: int) -> str:
        """The Mooncake object key a block is stored under."""
        return f"{self.namespace}/{key & 0xFFFF_FFFF_FFFF_FFFF:016x}"

    # KVTier

    def contains(self, key: int) -> bool:
        with self._lock:
            if self._closed:
                return False
            try:
                return self._client.is_exist(self.mooncake_key(key)) == 1
            except Exception as e:  # (a cache: a failing lookup is a miss)
                self._warn("exist", f"Mooncake is_exist failed: {e!r}")
                return False

    def load(self, key: int, out: memoryview) -> bool:
        t0 = time.perf_counter()
        dst = out if (out.format == "B" and out.ndim == 1) else out.cast("B")
        if dst.nbytes != self.block_nbytes or dst.readonly:
            raise ValueError(f"load into {dst.nbytes} {'read-only ' if dst.readonly else ''}bytes, "
                             f"the block is {self.block_nbytes} writable")
        with self._lock:
            ok = not self._closed and self._load_locked(key, dst)
            if ok:
                self._stats.hits += 1
                self._stats.loaded_bytes += self.block_nbytes
            else:
                self._stats.misses += 1
            self._stats.load_seconds += time.perf_counter() - t0
            return ok

    def _load_locked(self, key: int, dst: memoryview) -> bool:
        name = self.mooncake_key(key)
        try:
            if self._buf_ptr is not None:
                n = self._client.get_into(name, self._buf_ptr, self.entry_nbytes)
                if n == _INVALID_PARAMS and self._client.get_size(name) > self.entry_nbytes:
                    return self._drop(name, "verify_failures", "an entry larger than a block")
                if n < 0:
                    if n != _OBJECT_NOT_FOUND:
                        self._warn("get", f"Mooncake get_into {name} failed: {_error(n)}")
                    return False
                raw = memoryview(self._buf)[:n]
            else:
                data = self._client.get(name)
                if not data:
                    return False
                raw = memoryview(data)
        except Exception as e:  # (a cache: a failing load is a miss)
            self._warn("get", f"Mooncake get {name} failed: {e!r}")
            return False
        header = EntryHeader.unpack(raw)
        if header is None or len(raw) != self.entry_nbytes:
            return self._drop(name, "verify_failures", "not an entry of this block size")
        if self.ttl_s is not None and time.time() - header.stored_at > self.ttl_s:
            return self._drop(name, "expired", None)
        payload = raw[HEADER.size:]
        if not header.verifies(key, payload):
            return self._drop(name, "verify_failures", "digest or key mismatch")
        dst[:] = payload
        return True

    def _drop(self, name: str, counter: str, why: str | None) -> bool:
        """Remove an entry that must not be served (force: our own read may still hold its lease)."""
        setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        if why is not None:
            self._warn("verify", f"Mooncake entry {name} does not verify ({why}); removed")
        try:
            rc = self._client.remove(name, True)
        except Exception as e:
            rc = -1
            self._warn("remove", f"Mooncake remove {name} failed: {e!r}")
        if rc == 0:
            self._stored = max(0, self._stored - 1)
        elif rc != _OBJECT_NOT_FOUND:
            self._warn("remove", f"Mooncake remove {name} failed: {_error(rc)}")
        return False

    def save(self, key: int, payload: memoryview) -> None:
        """ValueError for a payload that is not one block (a caller's bug, not a failing tier)."""
        src = payload if (payload.format == "B" and payload.ndim == 1) else payload.cast("B")
        if src.nbytes != self.block_nbytes:
            raise ValueError(f"save of {src.nbytes} bytes, the block is {self.block_nbytes}")
        try:
            name = self.mooncake_key(key)
            with self._lock:
                if self._closed or self._client.is_exist(name) == 1:
                    return  # already stored (the lookup renews its lease: as good a touch as Mooncake has)
            value = b"".join((pack_header(key, src), src))  # digest and copy outside the lock
            with self._lock:
                if self._closed:
                    return
                rc = self._client.put(name, value)
                if rc == 0:
                    self._stored += 1
                    self._stats.saves += 1
                    self._stats.saved_bytes += self.block_nbytes
            if rc != 0:
                self._warn(f"put{rc}", f"Mooncake put {name} failed: {_error(rc)}; the block is not stored")
        except Exception as e:  # (a cache: a failed save is a block not stored)
            self._warn("put", f"Mooncake save failed: {e!r}; the block is not stored")

    def flush(self) -> None:
        """Nothing to wait for: a put has returned only once its data is in the pool."""

    def close(self) -> None:
        """Leave the pool: this process's segment, and the blocks in it, go with it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._buf_ptr is not None:
                    self._client.unregister_buffer(self._buf_ptr)
                self._client.close()
            except Exception as e:
                log.warning("Mooncake close failed: %r", e)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.used_blocks = min(self._stored, s.capacity_blocks)
            return s

    def __repr__(self) -> str:
        return f"MooncakeTier({self.master}, block_nbytes={self.block_nbytes}, ttl_s={self.ttl_s})"
