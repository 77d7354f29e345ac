"""ZeroMQ KV transport for workers on different hosts: signed messages over CURVE-encrypted TCP.

The prefill worker sends one message per layer per block range (header + raw bytes, no copy on
send: ZeroMQ's I/O thread puts them on the wire while the model computes the next layer) and a
final "fin"; the decode worker's receiver thread writes each slice into its pool and answers "fin"
with an ack, which, since one connection delivers in order, means every slice has landed.
Messages that fail the shared-secret check, or replay an earlier one, are refused without being
unpickled; a sender whose CURVE handshake fails (a wrong secret) fails its transfers at once, and the
receiver drops the connection of any frame bigger than one layer of its whole pool.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings

import torch
import zmq

from tandem.disagg.worker import secure, wire
from tandem.disagg.worker.transport import KVEndpoint, KVReceiver, KVSender, TransferError, TransferHandle, dtype_name
from tandem.kv.pool import KVPool

log = logging.getLogger(__name__)

REFUSED = b"refused"
MAX_ACK_FRAME = 64 << 10  # an ack carries a request id and at most one error message
HEADER_BYTES = 64 << 10  # a slice header without its block ids (which pickle to at most 8 bytes each)
HANDSHAKE_REFUSED = "the decode worker refused the connection: CURVE handshake failed (wrong shared secret?)"


def max_kv_frame(pool_shape: tuple[int, ...], itemsize: int) -> int:
    """The biggest frame a legitimate sender sends into this pool: one layer's K and V of every
    block (a write covers at most its reservation), or the header that names that many blocks."""
    return max(math.prod(pool_shape[1:]) * itemsize, HEADER_BYTES + 8 * pool_shape[2])


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class ZmqReceiver(KVReceiver):
    def __init__(self, host: str, port: int, secret: bytes) -> None:
        super().__init__()
        self.secret = secret
        self.host, self.port = host, port
        self._channel = wire.Channel(secret)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _attach(self, pool: KVPool) -> KVEndpoint:
        # Bound only now: the frame limit follows from the pool, and libzmq reads it at bind time.
        address = f"tcp://{self.host}"
        secure.server(self._sock, self.secret, address, max_kv_frame(pool.shape, pool.dtype.itemsize))
        if self.port:
            self._sock.bind(f"{address}:{self.port}")
        else:
            self.port = self._sock.bind_to_random_port(address)
        self._thread = threading.Thread(target=self._serve, name="tandem-kv-receiver", daemon=True)
        self._thread.start()
        return KVEndpoint("zmq", f"tcp://{self.host}:{self.port}", self.host, pool.shape, dtype_name(pool.dtype))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        errors: dict[str, str] = {}  # first failure per request, reported on its fin
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            try:
                header, payload = self._channel.verify([f.buffer for f in frames])
            except wire.AuthError as e:
                log.warning("refused a KV message: %s", e)
                self._sock.send_multipart([ident.bytes, REFUSED])
                continue
            kind, rid = header[0], header[1]
            if kind == "kv":
                _, _, layer, dst_block_ids, shape, dtype = header
                try:
                    with warnings.catch_warnings():  # a read-only buffer is fine: we only copy out of it
                        warnings.simplefilter("ignore")
                        kv = torch.frombuffer(payload[0], dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
                    self._write_locked(rid, layer, dst_block_ids, kv)
                except Exception as e:
                    errors.setdefault(rid, f"{type(e).__name__}: {e}")
            elif kind == "fin":
                error = errors.pop(rid, None)
                self._sock.send_multipart([ident.bytes, *self._channel.sign(("ack", rid, error))])

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        secure.release(self._sock)
        self._sock.close(linger=0)


class ZmqSender(KVSender):
    def __init__(self, secret: bytes) -> None:
        super().__init__()
        self.secret = secret
        self._channel = wire.Channel(secret)
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # address -> its socket's handshake reports
        self._refused: set[str] = set()  # addresses whose last handshake failed
        self._poller = zmq.Poller()
        self._inflight: dict[str, str] = {}  # request id -> address awaiting its ack

    def _sock(self, address: str) -> zmq.Socket:
        if address in self._refused:
            raise TransferError(HANDSHAKE_REFUSED)
        s = self._socks.get(address)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            secure.client(s, self.secret, address, MAX_ACK_FRAME)
            self._monitors[address] = secure.watch_handshakes(s)
            s.connect(address)
            self._poller.register(s, zmq.POLLIN)
            self._socks[address] = s
        return s

    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        header = ("kv", handle.request_id, layer, dst_block_ids, tuple(kv.shape), dtype_name(kv.dtype))
        # copy=False: ZeroMQ keeps a reference to the buffer until it is on the wire.
        self._sock(handle.endpoint.address).send_multipart(self._channel.sign(header, _as_bytes(kv)), copy=False)

    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        self._sock(handle.endpoint.address).send_multipart(self._channel.sign(("fin", handle.request_id)))
        self._inflight[handle.request_id] = handle.endpoint.address

    def _check(self) -> None:
        self._check_handshakes()
        while self._inflight:
            ready = dict(self._poller.poll(0))
            if not ready:
                return
            for sock in ready:
                frames = sock.recv_multipart()
                if frames == [REFUSED]:
                    # Everything sent on this connection was refused: fail what waits on it.
                    address = next(a for a, s in self._socks.items() if s is sock)
                    self._fail(address, "decode worker refused the transfer: wrong shared secret")
                    continue
                try:
                    (_, rid, error), _ = self._channel.verify(frames)
                except wire.AuthError as e:
                    log.warning("ignored an unsigned KV ack: %s", e)
                    continue
                if self._inflight.pop(rid, None) is not None:
                    self._complete(rid, error)

    def _check_handshakes(self) -> None:
        """A refused handshake is retried by libzmq forever: fail what waits on it now instead."""
        for address, monitor in self._monitors.items():
            for ok in secure.handshake_outcomes(monitor):
                if ok:
                    self._refused.discard(address)
                elif address not in self._refused:
                    log.warning("KV connection to %s: %s", address, HANDSHAKE_REFUSED)
                    self._refused.add(address)
            if address in self._refused:
                self._fail(address, HANDSHAKE_REFUSED)

    def _fail(self, address: str, reason: str) -> None:
        for rid in [r for r, a in self._inflight.items() if a == address]:
            del self._inflight[rid]
            self._complete(rid, reason)

    def forget(self, address: str) -> None:
        """The decode worker at address is gone: fail its transfers now rather than at their timeout."""
        self._fail(address, "the decode worker went away")
        self._refused.discard(address)
        s = self._socks.pop(address, None)
        if s is not None:
            self._poller.unregister(s)
            _close(s, self._monitors.pop(address))

    def close(self) -> None:
        for address, s in self._socks.items():
            _close(s, self._monitors[address])
        self._socks.clear()
        self._monitors.clear()


def _close(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    secure.unwatch(sock, monitor)
    sock.close(linger=0)


__all__ = ["TransferError", "ZmqReceiver", "ZmqSender"]
