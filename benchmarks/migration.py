"""Live migration: what moving a decoding stream to the other worker costs the client (issue #34 part 2).

    .venv/bin/python benchmarks/migration.py                       # shm and zmq, contexts 256, 1,024, 2,048
    .venv/bin/python benchmarks/migration.py --transports shm --contexts 512

Per transport, one `tandem serve --workers 2 --worker-cores 0 1 --kv-transport T --dtype D` (the default
model, two colocated workers of one core each; --dtype float32 by default, where greedy output does not
depend on the batch a request shares: in bf16 a stream's text can change with its neighbours, moved or not).
Per context length, --streams greedy streams (prompts of that many token ids, --max-tokens out, ignore_eos)
start together; once each has streamed --move-after chunks, `POST /v1/cluster/workers/{id}/migrate` moves
the busiest worker's streams to the other. Measured: the call's time per stream moved, each moved stream's
inter-token gap across the move against its median ITL before it (the pause the client sees), the KV bytes
moved (/v1/cluster's transfers) and so the effective copy rate; and whether each stream's text equals the
same request run again without a move.
Results: benchmarks/results/migration.json; plot docs/migration.png.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from server_process import add_server_args, serving

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
console = Console()


class Stream(threading.Thread):
    """One streamed completion: its chunks' arrival times and text."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.stamps: list[float] = []
        self.text: list[str] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = str(chunk["error"])
                            return
                        self.text.append(chunk["choices"][0]["text"])
                        self.stamps.append(time.monotonic())
        except httpx.HTTPError as e:
            self.error = repr(e)


def moved_bytes(url: str) -> int:
    return sum(t["bytes"] for t in httpx.get(f"{url}/v1/cluster", timeout=30).json()["transfers"])


def busiest(url: str) -> str:
    workers = httpx.get(f"{url}/v1/cluster", timeout=30).json()["workers"]
    return max(workers, key=lambda w: (w["in_flight"], w["id"]))["id"]


def reference(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]["text"]


def one_move(url: str, context: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 30000, context).tolist() for _ in range(args.streams)]
    streams = [Stream(url, p, args.max_tokens) for p in prompts]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 600
    while any(len(s.stamps) < args.move_after for s in streams) and time.monotonic() < deadline:
        if any(s.error or not s.is_alive() for s in streams):
            break
        time.sleep(0.01)
    before = moved_bytes(url)
    t0 = time.monotonic()
    answer = httpx.post(f"{url}/v1/cluster/workers/{busiest(url)}/migrate", timeout=600).json()
    t1 = time.monotonic()
    for s in streams:
        s.join()
    nbytes = moved_bytes(url) - before
    rows = []
    moved = set(answer.get("migrated", []))
    for s in streams:
        if s.error or len(s.stamps) < 3:
            rows.append({"error": s.error or "too few chunks"})
            continue
        stamps = np.array(s.stamps)
        gaps = np.diff(stamps)
        ends, starts = stamps[1:], stamps[:-1]
        before_gaps = gaps[ends < t0]
        during = gaps[(ends >= t0) & (starts <= t1)]  # the gaps the move's call overlapped
        rows.append({"median_itl_ms": float(np.median(before_gaps if len(before_gaps) else gaps)) * 1e3,
                     "gap_ms": float(during.max()) * 1e3 if len(during) else None,
                     "chunks": len(s.stamps), "text": "".join(s.text)})
    same = [r.get("text") == reference(url, p, args.max_tokens) for r, p in zip(rows, prompts, strict=True)]
    n = len(moved)
    # Only the moved streams paused; a stream that stayed keeps its ITL (its gap says the same).
    paused = sorted((r["gap_ms"] - r["median_itl_ms"] for r in rows if r.get("gap_ms") is not None), reverse=True)[:n]
    return {"context": context, "moved": n, "not_moved": answer.get("not_migrated", {}),
            "call_ms_per_stream": (t1 - t0) * 1e3 / n if n else None, "bytes": nbytes,
            "gb_s": nbytes / (t1 - t0) / 1e9 if n else None,
            "pause_ms": paused, "median_itl_ms": [r.get("median_itl_ms") for r in rows],
            "same_output": all(same), "errors": [r["error"] for r in rows if "error" in r]}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    transports = sorted({r["transport"] for r in results})
    contexts = sorted({r["context"] for r in results})
    width = 0.8 / len(transports)
    for i, t in enumerate(transports):
        ys = [np.mean(r["pause_ms"]) if r["pause_ms"] else 0 for c in contexts
              for r in results if r["transport"] == t and r["context"] == c]
        itl = [np.nanmean([x for x in r["median_itl_ms"] if x is not None]) for c in contexts
               for r in results if r["transport"] == t and r["context"] == c]
        xs = np.arange(len(contexts)) + i * width
        ax.bar(xs, ys, width, label=f"{t}: pause (gap - median ITL)")
        ax.plot(xs, itl, "k_", markersize=14, label="median ITL" if i == 0 else None)
    ax.set_xticks(np.arange(len(contexts)) + width * (len(transports) - 1) / 2, [str(c) for c in contexts])
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("ms")
    ax.set_title("Live migration: the pause a moved stream sees")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="shm,zmq")
    p.add_argument("--contexts", default="256,1024,2048")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--move-after", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--plot-path", type=Path, default=ROOT / "docs" / "migration.png")
    add_server_args(p, RESULTS / "migration", log_level="WARNING")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    contexts = [int(c) for c in args.contexts.split(",")]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        for transport in args.transports.split(","):
            flags = ["--workers", "2", "--worker-cores", "0", "1", "--kv-transport", transport, "--dtype", args.dtype]
            with serving(transport, flags, args, progress) as server:
                reference(server.url, [1, 2, 3], 4)  # warm both paths once
                for i, context in enumerate(contexts):
                    task = progress.add_task(f"{transport}: context {context}", total=None)
                    results.append({"transport": transport, **one_move(server.url, context, args, i)})
                    progress.remove_task(task)
    table = Table(title="live migration: a moved stream's pause")
    for col in ("transport", "context", "moved", "call ms / stream", "KV MB", "GB/s", "pause ms", "median ITL ms",
                "same output"):
        table.add_column(col, justify="right")
    for r in results:
        itl = [x for x in r["median_itl_ms"] if x is not None]
        table.add_row(r["transport"], str(r["context"]), str(r["moved"]),
                      f"{r['call_ms_per_stream']:.0f}" if r["call_ms_per_stream"] else "-", f"{r['bytes'] / 1e6:.1f}",
                      f"{r['gb_s']:.2f}" if r["gb_s"] else "-", ", ".join(f"{x:.0f}" for x in r["pause_ms"]),
                      f"{np.mean(itl):.0f}" if itl else "-", "yes" if r["same_output"] else "NO")
    console.print(table)
    out = RESULTS / "migration.json"
    out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    plot(results, args.plot_path)
    console.print(f"wrote {out} and {args.plot_path}")
    return 0 if all(r["same_output"] and r["moved"] and not r["errors"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
