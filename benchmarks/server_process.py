"""A `tandem serve` process for a benchmark: find the command, start it and wait for /health, read its
/metrics, send it a timed request, scan its log, stop it whole."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress

from tandem.bench.client import EndpointConfig, RequestRecord, send_request

console = Console(stderr=True)
LOG_PATTERN = re.compile(r"Traceback|ERROR|CRITICAL|WARNING|Exception|exception", re.IGNORECASE)


# The server's speculative-decoding counters (drafts verified, their tokens, accepted; accepted by position).
SPEC = ("tandem:spec_decode_num_drafts_total", "tandem:spec_decode_num_draft_tokens_total",
        "tandem:spec_decode_num_accepted_tokens_total")
PER_POSITION = "tandem:spec_decode_num_accepted_tokens_per_pos_total"


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


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path, progress: Progress | None,
                 label: str, poll_s: float = 1.0) -> None:
    task = progress.add_task(f"{label}: waiting for /health", total=None) if progress is not None else None
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
            time.sleep(poll_s)
        raise RunFailed(f"no 200 from /health in {timeout_s:.0f} s", log)
    finally:
        if progress is not None and task is not None:
            progress.remove_task(task)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: an exited process reparented to
    this container's init (multiprocessing's resource tracker) waits there a second or two to be reaped,
    and takes no core meanwhile."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


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


def add_server_args(p: argparse.ArgumentParser, out_dir: Path | None, log_level: str = "INFO") -> None:
    """The flags serving() reads: extra server flags, its log level (logs are scanned), its start-up
    patience, and (unless the script names its own) where results and logs go."""
    p.add_argument("--server-args", default="", help="extra `tandem serve` flags for every server, one string")
    p.add_argument("--server-log-level", default=log_level, help="the servers' --log-level (their logs are scanned)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    if out_dir is not None:
        p.add_argument("--out-dir", type=Path, default=out_dir, help="per-run client results, records and server logs")


@dataclass
class Server:
    name: str
    url: str
    command: list[str]
    log: Path


@contextlib.contextmanager
def serving(name: str, flags: list[str], args: argparse.Namespace, progress: Progress) -> Iterator[Server]:
    """A fresh `tandem serve` on a free loopback port (args: server_log_level, server_args, out_dir for the log,
    startup_timeout), stopped whole on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [tandem_exe(), "--log-level", args.server_log_level, "serve", "--port", str(port), *flags,
               *shlex.split(args.server_args)]
    log = args.out_dir / f"{name}.server.log"
    console.print(f"[bold]{name}[/]: {shlex.join(command)}")
    with log.open("w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, url, args.startup_timeout, log, progress, name)
        yield Server(name, url, command, log)
    finally:
        stop_server(proc)


def scrape(url: str, by: Sequence[str] = ("tier",)) -> dict[tuple[str, str | None], float]:
    """/metrics as (sample name, value of the first of the `by` labels it has) -> value, summed over any other
    labels."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, next((s.labels[b] for b in by if b in s.labels), None))
            out[key] = out.get(key, 0.0) + s.value
    return out


def counter_delta(before: dict, after: dict, name: str, label: str | None = None) -> float:
    return after.get((name, label), 0.0) - before.get((name, label), 0.0)


def log_issues(log: Path) -> list[str]:
    """The log's warning and error lines (the first 300 characters of each)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.strip()[:300] for line in lines if LOG_PATTERN.search(line)]


async def endpoint(http: httpx.AsyncClient, url: str, path: str) -> EndpointConfig:
    models = await http.get(f"{url}/v1/models")
    return EndpointConfig(url, path, model=models.json()["data"][0]["id"], ignore_eos=True)


async def timed(http: httpx.AsyncClient, cfg: EndpointConfig, prompt: str, out_len: int) -> RequestRecord:
    record = RequestRecord(0, 0, 0, "probe", 0, out_len)
    await send_request(http, cfg, prompt, record, time.perf_counter(), lambda text: 1)
    if not record.success:
        raise RuntimeError(f"request failed: {record.error}")
    return record
