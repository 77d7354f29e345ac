"""ZeroMQ KV transport for workers on different hosts: signed messages over TCP.

The prefill worker sends one message per layer per block range (header + raw bytes, no copy on
send: ZeroMQ's I/O thread puts them on the wire while the model computes the next layer) and a
final "fin"; the decode worker's receiver thread writes each slice into its pool and answers "fin"
with an ack, which, since one connection delivers in order, means every slice has landed.
Messages that fail the shared-secret check are refused without being unpickled.
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch
import zmq

from tandem.disagg import wire
from tandem.disagg.transport import KVEndpoint, KVReceiver, KVSender, TransferError, TransferHandle, dtype_name

log = logging.getLogger(__name__)

REFUSED = b"refused"


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class ZmqReceiver(KVReceiver):
    def __init__(self, host: str, port: int, secret: bytes) -> None:
        super().__init__()
        self.secret = secret
        self.host = host
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self._endpoint = KVEndpoint("zmq", f"tcp://{self.host}:{self.port}", self.host, tuple(shape),
                                    dtype_name(dtype))
        self._thread = threading.Thread(target=self._serve, name="tandem-kv-receiver", daemon=True)
        self._thread.start()
        return self.pool

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        errors: dict[str, str] = {}  # first failure per request, reported on its fin
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            try:
                header, payload = wire.verify(self.secret, [f.buffer for f in frames])
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
                self._sock.send_multipart([ident.bytes, *wire.sign(self.secret, ("ack", rid, error))])

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._sock.close(linger=0)


class ZmqSender(KVSender):
    def __init__(self, secret: bytes) -> None:
        super().__init__()
        self.secret = secret
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._inflight: dict[str, str] = {}  # request id -> address awaiting its ack

    def _sock(self, address: str) -> zmq.Socket:
        s = self._socks.get(address)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            self._poller.register(s, zmq.POLLIN)
            self._socks[address] = s
        return s

    def _write(self, handle: TransferHandle, layer: int, dst_block_ids: list[int], kv: torch.Tensor) -> None:
        header = ("kv", handle.request_id, layer, dst_block_ids, tuple(kv.shape), dtype_name(kv.dtype))
        # copy=False: ZeroMQ keeps a reference to the buffer until it is on the wire.
        self._sock(handle.endpoint.address).send_multipart(wire.sign(self.secret, header, _as_bytes(kv)), copy=False)

    def _finish(self, handle: TransferHandle, num_bytes: int) -> None:
        self._sock(handle.endpoint.address).send_multipart(wire.sign(self.secret, ("fin", handle.request_id)))
        self._inflight[handle.request_id] = handle.endpoint.address

    def _check(self) -> None:
        while self._inflight:
            ready = dict(self._poller.poll(0))
            if not ready:
                return
            for sock in ready:
                frames = sock.recv_multipart()
                if frames == [REFUSED]:
                    # Everything sent on this connection was refused: fail what waits on it.
                    address = next(a for a, s in self._socks.items() if s is sock)
                    for rid in [r for r, a in self._inflight.items() if a == address]:
                        del self._inflight[rid]
                        self._complete(rid, "decode worker refused the transfer: wrong shared secret")
                    continue
                try:
                    (_, rid, error), _ = wire.verify(self.secret, frames)
                except wire.AuthError as e:
                    log.warning("ignored an unsigned KV ack: %s", e)
                    continue
                if self._inflight.pop(rid, None) is not None:
                    self._complete(rid, error)

    def forget(self, address: str) -> None:
        """The decode worker at address is gone: fail its transfers now rather than at their timeout."""
        for rid in [r for r, a in self._inflight.items() if a == address]:
            del self._inflight[rid]
            self._complete(rid, "the decode worker went away")
        s = self._socks.pop(address, None)
        if s is not None:
            self._poller.unregister(s)
            s.close(linger=0)

    def close(self) -> None:
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()


__all__ = ["TransferError", "ZmqReceiver", "ZmqSender"]
