"""Signed messages between the router and workers, and between workers.

Every multipart message starts with a stamp (the sending socket's random session id and a counter
that only goes up) and ends with an HMAC-SHA256 over the stamp and every frame, keyed by the
deployment's shared secret. A message that fails the check is dropped before anything in it is
unpickled, so a peer without the secret can neither inject requests nor write KV, even on a TCP
port; one whose stamp is not newer than the last from its session is a replay and is dropped too.
Over TCP the frames also travel inside ZeroMQ CURVE (secure.py): this is the second layer.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import pickle
from collections import OrderedDict
from typing import Any, TypeVar

SECRET_ENV = "TANDEM_DISAGG_SECRET"

# The biggest router <-> worker frame we accept: a request with a million-token prompt pickles to
# about 5 MB, a step's outputs with top-20 logprobs for 1024 sequences to about 2 MB.
MAX_CONTROL_FRAME = 64 << 20
MAX_SESSIONS = 4096  # senders a receiver remembers; a fleet restarting for weeks stays well below

_SESSION_BYTES = 16
_STAMP_BYTES = _SESSION_BYTES + 8

K = TypeVar("K")
V = TypeVar("V")


class AuthError(Exception):
    """A message whose signature does not match the shared secret."""


class ReplayError(AuthError):
    """A correctly signed message that was already delivered (or is older than one that was)."""


def new_secret() -> bytes:
    return os.urandom(32)


def secret_from_env() -> bytes:
    value = os.environ.get(SECRET_ENV)
    if not value:
        raise ValueError(f"set {SECRET_ENV} to the deployment's shared secret (the router prints how)")
    return value.encode()


class LRU(OrderedDict[K, V]):
    """A dict that forgets its least recently written entries beyond max_size."""

    def __init__(self, max_size: int) -> None:
        super().__init__()
        self.max_size = max_size

    def put(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_size:
            self.popitem(last=False)


class ReplayGuard:
    """Per receiving socket: the last counter seen from each sending session."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._last: LRU[bytes, int] = LRU(max_sessions)

    def check(self, session: bytes, counter: int) -> None:
        last = self._last.get(session)
        if last is not None and counter <= last:
            raise ReplayError(f"replayed message (counter {counter}, last seen {last})")
        self._last.put(session, counter)

    def __len__(self) -> int:
        return len(self._last)


def _mac(secret: bytes, frames: list[Any]) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        frame = memoryview(frame).cast("B")
        mac.update(frame.nbytes.to_bytes(8, "little"))  # frame boundaries are part of what is signed
        mac.update(frame)
    return mac.digest()


class Channel:
    """One socket's signing: what it sends carries its own session and the next counter; what it
    receives must be signed with the secret and newer than anything seen from that session.
    One socket is driven by one thread, so neither side needs a lock."""

    def __init__(self, secret: bytes, max_sessions: int = MAX_SESSIONS) -> None:
        self.secret = secret
        self.session = os.urandom(_SESSION_BYTES)
        self._counter = itertools.count(1)
        self.guard = ReplayGuard(max_sessions)

    def sign(self, obj: Any, *payload: Any) -> list[Any]:
        """Frames for obj (pickled) and optional raw payload buffers (sent without copying)."""
        stamp = self.session + next(self._counter).to_bytes(8, "big")
        frames = [stamp, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), *payload]
        return [*frames, _mac(self.secret, frames)]

    def verify(self, frames: list[Any]) -> tuple[Any, list[Any]]:
        """(obj, payload frames) of a signed message; AuthError if it was not signed with the
        secret, ReplayError if it was delivered before."""
        if len(frames) < 3:
            raise AuthError("malformed message")
        body, mac = [memoryview(f) for f in frames[:-1]], bytes(frames[-1])
        if not hmac.compare_digest(_mac(self.secret, body), mac):
            raise AuthError("bad signature: wrong shared secret")
        stamp = bytes(body[0])
        if len(stamp) != _STAMP_BYTES:
            raise AuthError("malformed stamp")
        self.guard.check(stamp[:_SESSION_BYTES], int.from_bytes(stamp[_SESSION_BYTES:], "big"))
        return pickle.loads(body[1]), body[2:]
