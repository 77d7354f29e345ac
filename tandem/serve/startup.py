"""What `tandem serve` tells a person while it starts: checks that fail before anything loads (the
port is taken, the model file is missing), each naming the flag or file to fix; and, once the
socket is bound, where it serves, where the dashboard is and how to stop it."""

from __future__ import annotations

import errno
import socket
from typing import Any

import uvicorn

from tandem.logs import startup


def bind_port(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound now (uvicorn listens on it once the app is built): a taken port fails
    before a minute of loading, not after, and no port this process picks meanwhile (the router's
    for its workers) can be the one it was asked to serve on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
    try:
        s.bind((host, port))
        return s
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use: stop what holds it or pick another with "
                             "--port") from None
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ValueError(f"--host {host}: not an address of this machine") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"--port {port}: binding it needs privileges; use a port above 1023") from None
        raise ValueError(f"cannot serve on {host}:{port} (--host, --port): {e.strerror}") from None
    except socket.gaierror as e:
        s.close()
        raise ValueError(f"--host {host}: {e.strerror}") from None


def check_memory(kv_cache_memory_gib: float, num_engines: int) -> None:
    """Each engine commits its KV pool at start: refuse a budget the machine cannot hold, by flag."""
    try:
        with open("/proc/meminfo") as f:
            available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return  # not Linux, or no figure: the engine reports its own failure
    need, have = kv_cache_memory_gib * num_engines, available_kib / 2**20
    if need > have:
        each = f" ({num_engines} engines x {kv_cache_memory_gib:g} GiB)" if num_engines > 1 else ""
        raise ValueError(f"--kv-cache-memory {kv_cache_memory_gib:g}: the KV pools need {need:.1f} GiB{each}, "
                         f"more than the {have:.1f} GiB this machine has available; lower it (or use --num-blocks)")


def urls(host: str, port: int) -> dict[str, str]:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    base = f"http://{shown}:{port}"
    return {"api": f"{base}/v1", "dashboard": f"{base}/dashboard", "metrics": f"{base}/metrics",
            "health": f"{base}/health"}


def announce(host: str, port: int, model: str, protected: bool) -> None:
    u = urls(host, port)
    key_note = " (the API key of --api-key opens it)" if protected else ""
    startup.info("serving %s: OpenAI API at %s, dashboard at %s%s, metrics at %s. Ctrl-C (or SIGTERM) stops it.",
                 model, u["api"], u["dashboard"], key_note, u["metrics"],
                 extra={"event": "serving", "urls": u, "model": model})


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, saying where it serves once its socket is bound (not before)."""

    def __init__(self, config: uvicorn.Config, model: str, protected: bool) -> None:
        super().__init__(config)
        self.model, self.protected = model, protected

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            announce(self.config.host, self.config.port, self.model, self.protected)
