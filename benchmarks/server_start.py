"""How long `tandem serve` takes to answer /health, the CPU its processes spend getting there, what the
API process holds (its resident memory, whether torch is mapped into it) and how long the whole process
tree takes to exit after SIGTERM. Optionally side by
side with another revision (a git worktree run by the same interpreter), one start of each in turn so
that a noisy machine weighs on both alike.

    .venv/bin/python benchmarks/server_start.py --starts 3 --baseline 62b0d2c -- --kv-cache-memory 0.5

Every test that starts a server, and every restart of a worker, pays this: it is most of what the
suite's 40-odd process trees cost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from server_process import console, free_port, group_alive, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Start:
    tree: str
    health_s: float  # from the command's start to the first 200 from /health
    cpu_s: float  # user + system seconds of the server and every process under it, at that moment
    api_rss_mib: float
    api_has_torch: bool
    stop_s: float  # from SIGTERM to the last process of the tree gone


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [c for p in map(int, out) for c in (p, *descendants(p))]


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def one_start(tree: str, path: Path, serve_args: list[str]) -> Start:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(path)}
    log = Path(tempfile.gettempdir()) / f"tandem-start-{port}.log"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), *serve_args],
                                cwd=path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 300, log, None, tree, poll_s=0.05)
        health = time.perf_counter() - t0
        cpu = sum(cpu_seconds(p) for p in (proc.pid, *descendants(proc.pid)))
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
        torch = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        while group_alive(proc.pid):
            time.sleep(0.005)
        return Start(tree, health, cpu, rss, torch, time.perf_counter() - t1)
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)  # a failed start's tail is in the RunFailed raised


@contextmanager
def worktree(rev: str):  # noqa: ANN201
    """The revision checked out beside this one (its compiled kernels build on first use, as any checkout's)."""
    path = Path(tempfile.mkdtemp(prefix="tandem-start-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=3, help="starts of each tree")
    p.add_argument("--baseline", default=None, help="a git revision to start alternately with this tree")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/server_start.json")
    p.add_argument("serve_args", nargs="*", help="flags for `tandem serve` (after --)")
    args = p.parse_args()
    trees = {"this tree": ROOT}
    with worktree(args.baseline) if args.baseline else _nothing() as base:
        if base is not None:
            trees[f"baseline {args.baseline}"] = base
            one_start("warm-up", base, args.serve_args)  # its kernels and step profile, outside the timing
        one_start("warm-up", ROOT, args.serve_args)
        starts = [one_start(name, path, args.serve_args) for _ in range(args.starts) for name, path in trees.items()]
    console.print(f"[bold]tandem serve {' '.join(args.serve_args)}[/], {args.starts} starts each, "
                  f"{os.cpu_count()} CPUs")
    summary = {}
    for name in trees:
        mine = [s for s in starts if s.tree == name]
        keys = ("health_s", "cpu_s", "api_rss_mib", "stop_s")
        summary[name] = {key: statistics.median(getattr(s, key) for s in mine) for key in keys} | \
            {"api_has_torch": mine[0].api_has_torch}
        m = summary[name]
        torch = "mapped" if m["api_has_torch"] else "not mapped"
        console.print(f"  {name:>22}: /health in {m['health_s']:.2f} s (median), {m['cpu_s']:.2f} CPU-s by then, "
                      f"API process {m['api_rss_mib']:.0f} MiB resident, torch {torch}, stopped in {m['stop_s']:.2f} s"
                      f"  [{', '.join(f'{s.health_s:.2f}' for s in mine)} s]")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"serve_args": args.serve_args, "summary": summary,
                                       "starts": [asdict(s) for s in starts]}, indent=1))
    console.print(f"wrote {args.output}")


@contextmanager
def _nothing():  # noqa: ANN202
    yield None


if __name__ == "__main__":
    main()
