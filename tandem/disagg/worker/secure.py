"""Private, authenticated TCP between the deployment's processes: ZeroMQ CURVE keyed by its secret.

Both key pairs come from the shared secret (HKDF-SHA256, one label each): every binding socket
(router, KV receiver) is the "server" pair, every connecting socket (worker, KV sender) the
"client" pair. A client must know the server's public key to start the handshake at all, and a
ZAP handler on the server's context admits only the client public key of the same secret, so a
peer that learned the server's public key is still refused. The HMAC signature (wire.py) stays on
as a second layer. ipc:// and inproc:// sockets are left alone: the OS already guards them.

Every socket that receives from peers also gets ZMQ_MAXMSGSIZE: libzmq reads a frame's size before
its body and drops the connection of a frame that is too big, so nothing oversize is buffered.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache

import zmq
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

CURVE_OVERHEAD = 64  # bytes CURVE adds around a frame on the wire (command name, nonce, MAC, flags)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_SALT = b"tandem disagg curve v1"
_ZAP_ADDRESS = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27), and where pyzmq binds
_DENIAL_LOG_INTERVAL_S = 60.0  # an intruder reconnects every 100 ms: log it once a minute


@dataclass(frozen=True)
class CurveKeys:
    """z85-encoded, as ZeroMQ's CURVE options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def domain(self) -> str:
        """ZAP domain of this deployment's servers: one context may host servers of several secrets (tests)."""
        return "tandem-" + self.server_public.decode()


def _hkdf(secret: bytes, label: bytes) -> bytes:
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()  # one 32-byte block of RFC 5869 expand


@lru_cache(maxsize=16)
def derive_keys(secret: bytes) -> CurveKeys:
    server_secret = z85.encode(_hkdf(secret, b"server"))
    client_secret = z85.encode(_hkdf(secret, b"client"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def limit_frames(sock: zmq.Socket, max_frame: int) -> None:
    """Before bind/connect: a peer's frame bigger than max_frame bytes drops its connection."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + CURVE_OVERHEAD)


def server(sock: zmq.Socket, secret: bytes, address: str, max_frame: int) -> None:
    """Before bind: encrypt, and admit only clients holding the deployment's client key."""
    limit_frames(sock, max_frame)
    if not is_tcp(address):
        return
    keys = derive_keys(secret)
    _admit(sock, keys)
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = keys.domain.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # fail closed: with no ZAP handler, admit nobody


def client(sock: zmq.Socket, secret: bytes, address: str, max_frame: int) -> None:
    """Before connect: encrypt, and prove to the server that we hold the secret."""
    limit_frames(sock, max_frame)
    if not is_tcp(address):
        return
    keys = derive_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def release(sock: zmq.Socket) -> None:
    """Before closing a socket set up with server(): the last one on a context stops its ZAP thread
    (a context with an open ZAP socket would never terminate)."""
    with _lock:
        gate = _gates.get(sock.context.underlying)
        if gate is None or gate.auth.context is not sock.context:
            return
        gate.sockets.discard(sock.underlying)
        if not gate.sockets:
            del _gates[sock.context.underlying]
            gate.auth.stop()


# -- the ZAP handler: one per context (libzmq looks for it at one inproc address per context) -----
@dataclass
class _Allow:
    client_public: bytes
    last_denial: float = field(default=-_DENIAL_LOG_INTERVAL_S)

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        now = time.monotonic()
        if now - self.last_denial >= _DENIAL_LOG_INTERVAL_S:
            self.last_denial = now
            log.warning("refused a connection from a peer without the deployment's secret (CURVE key %s)",
                        key.decode(errors="replace"))
        return False


class _FreeOnStop(Authenticator):
    def stop(self) -> None:
        # A closed socket's address is freed later, on libzmq's reaper thread: unbind it now, or
        # the next server on this context could not start its ZAP handler.
        if self.zap_socket:
            self.zap_socket.unbind(_ZAP_ADDRESS)
        super().stop()


class _Authenticator(ThreadAuthenticator, _FreeOnStop):
    """ThreadAuthenticator.stop joins its thread, then _FreeOnStop unbinds, then the socket closes."""


@dataclass
class _Gate:
    auth: _Authenticator
    sockets: set[int] = field(default_factory=set)


_gates: dict[int, _Gate] = {}
_lock = threading.Lock()


def _admit(sock: zmq.Socket, keys: CurveKeys) -> None:
    with _lock:
        gate = _gates.get(sock.context.underlying)
        # A gate left by a context that was terminated unreleased must not stand in for a live one.
        if gate is None or gate.auth.context is not sock.context or not gate.auth.is_alive():
            auth = _Authenticator(sock.context)
            auth.start()  # before the bind: until a ZAP handler answers, every client is refused
            gate = _gates[sock.context.underlying] = _Gate(auth)
        if keys.domain not in gate.auth.credentials_providers:
            gate.auth.configure_curve_callback(keys.domain, _Allow(keys.client_public))
        gate.sockets.add(sock.underlying)


# -- handshake outcomes, for a client that must not wait for a timeout to learn it was refused ----
_monitors = itertools.count()


def watch_handshakes(sock: zmq.Socket) -> zmq.Socket:
    """Before connect: a socket that reports each CURVE handshake of sock (see handshake_outcomes)."""
    address = f"inproc://tandem-handshakes-{id(sock)}-{next(_monitors)}"
    sock.monitor(address, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    monitor = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
    monitor.connect(address)
    return monitor


def handshake_outcomes(monitor: zmq.Socket) -> list[bool]:
    """The handshakes reported since the last call: True for one that succeeded."""
    outcomes = []
    while monitor.poll(0):
        event = recv_monitor_message(monitor)["event"]
        if event & (HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            outcomes.append(event == zmq.EVENT_HANDSHAKE_SUCCEEDED)
    return outcomes


def unwatch(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
