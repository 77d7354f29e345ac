"""Signed messages between the router and workers, and between workers.

Every multipart message ends with an HMAC-SHA256 over its frames, keyed by the deployment's shared
secret. A message that fails the check is dropped before anything in it is unpickled, so a peer
without the secret can neither inject requests nor write KV, even on a TCP port.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from typing import Any

SECRET_ENV = "TANDEM_DISAGG_SECRET"


class AuthError(Exception):
    """A message whose signature does not match the shared secret."""


def new_secret() -> bytes:
    return os.urandom(32)


def secret_from_env() -> bytes:
    value = os.environ.get(SECRET_ENV)
    if not value:
        raise ValueError(f"set {SECRET_ENV} to the deployment's shared secret (the router prints how)")
    return value.encode()


def _mac(secret: bytes, frames: list[Any]) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        frame = memoryview(frame).cast("B")
        mac.update(frame.nbytes.to_bytes(8, "little"))  # frame boundaries are part of what is signed
        mac.update(frame)
    return mac.digest()


def sign(secret: bytes, obj: Any, *payload: Any) -> list[Any]:
    """Frames for obj (pickled) and optional raw payload buffers (sent without copying)."""
    frames = [pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), *payload]
    return [*frames, _mac(secret, frames)]


def verify(secret: bytes, frames: list[Any]) -> tuple[Any, list[Any]]:
    """(obj, payload frames) of a signed message; AuthError if it was not signed with secret."""
    if len(frames) < 2:
        raise AuthError("malformed message")
    body, mac = [memoryview(f) for f in frames[:-1]], bytes(frames[-1])
    if not hmac.compare_digest(_mac(secret, body), mac):
        raise AuthError("bad signature: wrong shared secret")
    return pickle.loads(body[0]), body[1:]
