"""Start a real `tandem serve` process on a free loopback port for a test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

# The tests' plain requests go through one client: web.get() and friends build a client, and with it an
# SSL context (certifi's bundle parsed: about 25 ms of CPU), on every call, which added up to a minute
# of a suite's polling. No keep-alive, so each request still opens its own connection as httpx.get does.
web = httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if web.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become healthy")

    def metric(self, name: str) -> float:
        text = web.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(f"tandem:{name}{{") or line.startswith(f"tandem:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None):  # noqa: ANN201
    server = Server(list(args), env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def cmdline(pid: int) -> bytes:
    """A process's command line, or b"" once it has exited (a child can end between pgrep and the read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
