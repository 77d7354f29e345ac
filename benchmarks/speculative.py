"""Speculative decoding on and off, side by side in one run: one `tandem serve` per configuration
(off, ngram, suffix), each under the same `tandem bench serve` workloads:

    copy     copy-heavy chat prompts (edit this code, summarise with quotes, rewrite this JSON; from
             what ships with Python, `--dataset-name copy`), about 512 tokens in, up to 256 out
    random   random words, 256 in / 128 out (nothing to copy: speculation must cost nothing)

at concurrency 1, 4, 16 and 64, greedy. Prints output tokens/s and TPOT per configuration with the
ratio to speculation off, and each proposer's acceptance (from the server's spec_decode_* counters);
writes benchmarks/results/speculative/summary.json and speculative.png.

    .venv/bin/python benchmarks/speculative.py
    .venv/bin/python benchmarks/speculative.py --configs off,suffix --concurrency 1 --workloads copy
    .venv/bin/python benchmarks/speculative.py --configs 'off;k16={"method": "ngram", "num_speculative_tokens": 16}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from server_process import (
    PER_POSITION,
    SPEC,
    RunFailed,
    add_server_args,
    bench_serve,
    counter_delta,
    scrape,
    serving,
    tandem_exe,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "off": [],
    "ngram": ["--speculative-config", json.dumps({"method": "ngram"})],
    "suffix": ["--speculative-config", json.dumps({"method": "suffix"})],
}
PROMPTS_PER_STREAM = {1: 4, 4: 2, 16: 1, 64: 1}  # prompts = concurrency x this: every run fills its streams


@dataclass(frozen=True)
class Workload:
    name: str
    flags: tuple[str, ...]


WORKLOADS = {
    "copy": Workload("copy", ("--backend", "openai-chat", "--dataset-name", "copy", "--copy-input-len", "512",
                              "--copy-output-len", "256")),
    "random": Workload("random", ("--dataset-name", "random", "--random-input-len", "256", "--random-output-len",
                                  "128", "--ignore-eos")),
}


def run_config(name: str, args: argparse.Namespace, progress: Progress) -> list[dict]:
    rows = []
    spec = CONFIGS[name] if name in CONFIGS else ["--speculative-config", name.partition("=")[2]]
    flags = ["--dtype", args.dtype, "--max-num-seqs", "64", *spec]
    name = name.partition("=")[0]
    with serving(name, flags, args, progress) as server:
        for wname in args.workloads.split(","):
            w = WORKLOADS[wname]
            for c in (int(x) for x in args.concurrency.split(",")):
                out = args.out_dir / f"{name}-{wname}-c{c}.json"
                before = scrape(server.url, by=("position",))
                t0 = time.monotonic()
                bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, *w.flags,
                             "--max-concurrency", str(c), "--num-prompts", str(c * PROMPTS_PER_STREAM.get(c, 1)),
                             "--num-warmups", "1", "--seed", str(args.seed), "--save-result", "--result-dir",
                             str(args.out_dir), "--result-filename", out.name, "--label", f"{name} {wname} c{c}"],
                            args.out_dir / "client.log", progress, f"{name} {wname} c{c}")
                after = scrape(server.url, by=("position",))
                drafts, draft_tokens, accepted = (counter_delta(before, after, m) for m in SPEC)
                per_pos = [counter_delta(before, after, PER_POSITION, str(i)) / drafts if drafts else 0.0
                           for i in range(16)]
                r = json.loads(out.read_text())
                row = {"config": name, "workload": wname, "concurrency": c, "wall_s": time.monotonic() - t0,
                       "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
                       "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                       "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                       "acceptance_per_position": [round(p, 3) for p in per_pos if p > 0],
                       **{k: r.get(k) for k in ("output_throughput", "total_output_tokens", "median_tpot_ms",
                                                "median_ttft_ms", "median_itl_ms", "completed")}}
                rows.append(row)
                console.print(f"  {wname} c{c}: {row['output_throughput']:.1f} tok/s out, TPOT p50 "
                              f"{row['median_tpot_ms']:.1f} ms, acceptance "
                              f"{row['acceptance_rate'] if row['acceptance_rate'] is not None else '-'}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    base = {(r["workload"], r["concurrency"]): r["output_throughput"] for r in rows if r["config"] == "off"}
    for ax, w in zip(axes[0], workloads, strict=True):
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r["concurrency"], r["output_throughput"] / base[(w, r["concurrency"])])
                         for r in rows if r["workload"] == w and r["config"] == config
                         and base.get((w, r["concurrency"])))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{w}: output tokens/s vs speculation off", xlabel="concurrency", ylabel="ratio")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="names of " + ", ".join(CONFIGS) + ", or NAME=JSON for a --speculative-config, ';'-separated")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    add_server_args(ap, ROOT / "benchmarks/results/speculative")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with Progress(console=console, transient=True) as progress:
        for name in args.configs.split(";" if ";" in args.configs else ","):
            try:
                rows += run_config(name, args, progress)
            except RunFailed as e:
                console.print(f"[red]{name}: {e}[/]\n{e.detail}")
    (args.out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["config"] == "off"}
    table = Table("workload", "c", "config", "out tok/s", "vs off", "TPOT p50 ms", "TTFT p50 ms", "acceptance",
                  "mean accepted length")
    for r in rows:
        b = base.get((r["workload"], r["concurrency"]))
        ratio = f"{r['output_throughput'] / b['output_throughput']:.2f}x" if b and b["output_throughput"] else "-"
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        table.add_row(r["workload"], str(r["concurrency"]), r["config"], f"{r['output_throughput']:.1f}", ratio,
                      f"{r['median_tpot_ms']:.1f}", f"{r['median_ttft_ms']:.0f}", rate, length)
    console.print(table)
    if base:
        plot(rows, args.out_dir / "speculative.png")
        console.print(f"plot: {args.out_dir / 'speculative.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
