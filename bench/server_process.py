"""A `tandem serve` process for a benchmark: find the command, wait for /health, stop it whole."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

console = Console(stderr=True)


def tandem_exe() -> str:
    # The venv's script next to this interpreter, so the server and client run the checkout being measured.
    local = Path(sys.executable).with_name("tandem")
    found = str(local) if local.exists() else shutil.which("tandem")
    if not found:
        raise SystemExit("cannot find the `tandem` command; run with the venv's python")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class RunFailed(Exception):
    """A configuration could not finish: `str()` is one line for the summary, `detail` the log's tail."""

    def __init__(self, summary: str, log: Path) -> None:
        self.detail = log_tail(log)
        last = self.detail.splitlines()[-1].strip() if self.detail.strip() else ""
        super().__init__(f"{summary}: {last}" if last else summary)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path, progress: Progress,
                 label: str) -> None:
    task = progress.add_task(f"{label}: waiting for /health", total=None)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RunFailed(f"server exited with code {proc.returncode}", log)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(1)
        raise RunFailed(f"no 200 from /health in {timeout_s:.0f} s", log)
    finally:
        progress.remove_task(task)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL the session it leads if anything lingers."""
    patience = 10.0
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            console.print("[yellow]server did not exit in 30 s after SIGTERM; killing it[/]")
            patience = 0.0
    # The server was started as its own session, so its group holds only it and its engine processes; a
    # leftover engine process would steal cores from the next configuration.
    deadline = time.monotonic() + patience
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def bench_serve(flags: list[str], client_log: Path, progress: Progress, label: str) -> None:
    """One `tandem bench serve`; its console report goes to the client log."""
    task = progress.add_task(label, total=None)
    try:
        with client_log.open("a") as f:
            f.write(f"\n$ {shlex.join(flags)}\n")
            f.flush()
            rc = subprocess.run(flags, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
        if rc != 0:
            raise RunFailed(f"{label}: `tandem bench serve` exited with {rc}", client_log)
    finally:
        progress.remove_task(task)
