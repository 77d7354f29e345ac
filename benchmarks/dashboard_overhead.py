"""What the dashboard costs a busy server, side by side in one run: one `tandem serve`, the same
`tandem bench serve` load again and again (fresh prompts each time), in rounds of three:

    off    nobody looks
    poll   a client polls GET /v1/cluster at the page's interval (the server's side of the cost)
    page   Debian's headless Chromium has /dashboard open, polling and redrawing (the browser runs on
           the same two cores here: the worst case; an operator's browser is usually elsewhere)

Prints each condition's output tokens/s (mean over rounds) and its ratio to `off`, and how long the
server took to answer /v1/cluster under load; writes benchmarks/results/dashboard/summary.json.
Goal: both ratios within 2% of 1.

    .venv/bin/python benchmarks/dashboard_overhead.py
    .venv/bin/python benchmarks/dashboard_overhead.py --rounds 3 --interval 1 --concurrency 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from server_process import add_server_args, bench_serve, serving, tandem_exe

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("off", "poll", "page")
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1800")


@contextlib.contextmanager
def poller(url: str, interval: float, latencies: list[float]) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                t0 = time.perf_counter()
                http.get(f"{url}/v1/cluster").raise_for_status()
                latencies.append(time.perf_counter() - t0)
                stop.wait(interval)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def page(url: str, interval: float) -> Iterator[None]:
    browser = shutil.which("chromium")
    if browser is None:
        raise SystemExit("Debian's chromium is not installed (scripts/setup.sh installs it as root)")
    with tempfile.TemporaryDirectory(prefix="tandem-dash-") as profile:
        proc = subprocess.Popen([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                 f"{url}/dashboard?interval={interval:g}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            time.sleep(3)  # loaded and drawing before the load starts
            if proc.poll() is not None:
                raise SystemExit(f"chromium exited with {proc.returncode}")
            yield
        finally:
            proc.terminate()
            proc.wait(30)


def output_throughput(path: Path) -> float:
    return float(json.loads(path.read_text())["output_throughput"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between polls (the page's default)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    add_server_args(ap, ROOT / "benchmarks/results/dashboard", "WARNING")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    throughput: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    latencies: list[float] = []
    with Progress(console=console, transient=True) as progress, serving("dashboard", [], args, progress) as server:
        seed = 1000
        for r in range(args.rounds):
            # Rotate the order each round: a drift of the machine over the run lands on every condition.
            for cond in CONDITIONS[r % 3:] + CONDITIONS[:r % 3]:
                seed += 1
                out = args.out_dir / f"{cond}-{r}.json"
                watch = (poller(server.url, args.interval, latencies) if cond == "poll" else
                         page(server.url, args.interval) if cond == "page" else contextlib.nullcontext())
                with watch:
                    bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--ignore-eos",
                                 "--random-input-len", str(args.input_len), "--random-output-len",
                                 str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
                                 str(args.concurrency), "--seed", str(seed), "--save-result", "--disable-tqdm",
                                 "--result-dir", str(args.out_dir), "--result-filename", out.name],
                                args.out_dir / "client.log", progress, f"round {r + 1}: {cond}")
                throughput[cond].append(output_throughput(out))
                console.print(f"round {r + 1} {cond}: {throughput[cond][-1]:.1f} output tok/s")
    base = statistics.mean(throughput["off"])
    table = Table(title=f"dashboard overhead: c{args.concurrency}, {args.input_len}/{args.output_len} tokens, "
                        f"polling every {args.interval:g} s, {args.rounds} rounds")
    for col in ("condition", "output tok/s (each round)", "mean", "vs off"):
        table.add_column(col, justify="right")
    summary: dict = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "conditions": {}}
    for cond in CONDITIONS:
        mean = statistics.mean(throughput[cond])
        summary["conditions"][cond] = {"output_throughput": throughput[cond], "mean": mean, "ratio": mean / base}
        table.add_row(cond, ", ".join(f"{v:.1f}" for v in throughput[cond]), f"{mean:.1f}", f"{mean / base:.3f}")
    console.print(table)
    if latencies:
        ms = sorted(v * 1000 for v in latencies)
        summary["cluster_endpoint_ms"] = {"p50": statistics.median(ms), "max": ms[-1], "n": len(ms)}
        console.print(f"GET /v1/cluster under load: p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms "
                      f"({len(ms)} polls)")
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
