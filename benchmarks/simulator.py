"""The simulator against the live server (issue #19): predicted vs measured TTFT and TPOT (p50, p90) for a
colocated server and a 1P1D deployment, at three request rates and on two workloads, the simulator
calibrated from `tandem profile` alone.

    .venv/bin/python benchmarks/simulator.py                  # the full run (~25 min)
    .venv/bin/python benchmarks/simulator.py --quick          # a smoke check (one rate, few requests)
    .venv/bin/python benchmarks/simulator.py --reuse-profiles # keep the profiles of an earlier run

Profiles: the colocated engine as `tandem serve` runs it (every core), and a worker's engine as a local 1P1D
deployment pins it (one core, one thread). The server's API process, and the benchmark client, share the
cores with the engine: the profile does not see them, and neither does the simulator.
Results: benchmarks/results/sim/ (profiles, per-run JSON of both, summary.json, summary.md, simulator.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from server_process import add_server_args, bench_serve, serving, tandem_exe

console = Console(stderr=True)
RatesOf = Callable[[str, str], list[float]]
METRICS = [("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90")]

DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "colocated": {"serve": [], "sim": "1C", "profile": "colocated"},
    # Every prompt through the pair, as the simulator runs it (the per-request path choice is not simulated).
    "1p1d": {"serve": ["--prefill-workers", "1", "--decode-workers", "1", "--worker-cores", "0", "1",
                       "--path-policy", "disaggregated"], "sim": "1P1D", "profile": "worker"},
}
# The serving calibration runs each profile's engine as the deployment runs it: the colocated server, and
# the 1P1D deployment itself (its router shares the two cores with the workers).
PROFILES = {"colocated": [],
            "worker": ["--cores", "0", "--num-threads", "1", "--serve-args",
                       "--prefill-workers 1 --decode-workers 1 --worker-cores 0 1 --path-policy disaggregated"]}
WORKLOADS: dict[str, dict[str, Any]] = {
    "random": {"flags": ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64"],
               "rates": {"colocated": [0.4, 0.8, 1.2], "1p1d": [0.2, 0.4, 0.6]}, "seed": 11},
    "chat": {"flags": ["--dataset-name", "synthetic_chat"],
             "rates": {"colocated": [0.5, 1.0, 1.5], "1p1d": [0.25, 0.5, 0.75]}, "seed": 23},
}


def run_profile(name: str, out_dir: Path, reuse: bool) -> Path:
    path = out_dir / f"{name}.json"
    if reuse and path.exists():
        return path
    console.print(f"[bold]profile {name}[/]")
    subprocess.run([tandem_exe(), "profile", *PROFILES[name], "-o", str(path)], check=True)
    return path


def result_path(out_dir: Path, kind: str, dep: str, workload: str, rate: float) -> Path:
    return out_dir / f"{kind}-{dep}-{workload}-{rate:g}.json"


def common_flags(workload: str, rate: float, num_prompts: int) -> list[str]:
    """A seed per workload and rate: no two runs against one server share prompts (the prefix cache would
    hide their prefill), and the simulator replays each run's own prompts and arrivals."""
    w = WORKLOADS[workload]
    seed = w["seed"] + 1000 * round(rate * 100)
    return [*w["flags"], "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--metric-percentiles", "50,90", "--save-result"]


def measure(dep: str, workloads: list[str], num_prompts: int, args: argparse.Namespace, rates_of: RatesOf) -> None:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, serving(dep, DEPLOYMENTS[dep]["serve"], args,
                                                                   progress) as server:
        for workload in workloads:
            for rate in rates_of(dep, workload):
                out = result_path(args.out_dir, "measured", dep, workload, rate)
                flags = [tandem_exe(), "bench", "serve", "--base-url", server.url, "--ignore-eos", "--disable-tqdm",
                         "--num-warmups", "2", *common_flags(workload, rate, num_prompts), "--result-dir",
                         str(out.parent), "--result-filename", out.name, "--label", f"measured {dep}"]
                bench_serve(flags, args.out_dir / f"{dep}.client.log", progress, f"{dep} {workload} @ {rate:g}/s")


def simulate(dep: str, workload: str, rate: float, num_prompts: int, profile: Path, out_dir: Path) -> None:
    out = result_path(out_dir, "predicted", dep, workload, rate)
    subprocess.run([tandem_exe(), "bench", "sim", "--profile", str(profile), "--deployment", DEPLOYMENTS[dep]["sim"],
                    *common_flags(workload, rate, num_prompts), "--result-dir", str(out.parent),
                    "--result-filename", out.name, "--label", f"predicted {dep}"], check=True,
                   stdout=subprocess.DEVNULL)


def rows(out_dir: Path, deps: list[str], workloads: list[str], rates_of: RatesOf) -> list[dict[str, Any]]:
    table = []
    for dep in deps:
        for workload in workloads:
            for rate in rates_of(dep, workload):
                measured = json.loads(result_path(out_dir, "measured", dep, workload, rate).read_text())
                predicted = json.loads(result_path(out_dir, "predicted", dep, workload, rate).read_text())
                row: dict[str, Any] = {"deployment": dep, "workload": workload, "rate": rate,
                                       "completed": measured["completed"]}
                for metric, stat in METRICS:
                    key = f"{'median' if stat == 'p50' else stat}_{metric}_ms"
                    m, p = measured[key], predicted[key]
                    row[f"{metric}_{stat}"] = {"measured": m, "predicted": p, "error": (p - m) / m if m else None}
                table.append(row)
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    head = "| deployment | workload | rate | " + " | ".join(f"{m.upper()} {s} meas / pred (err)" for m, s in METRICS)
    lines = [head + " |", "|" + "---|" * (3 + len(METRICS))]
    for r in table:
        cells = []
        for metric, stat in METRICS:
            c = r[f"{metric}_{stat}"]
            err = "" if c["error"] is None else f" ({c['error'] * 100:+.0f}%)"
            cells.append(f"{c['measured']:.0f} / {c['predicted']:.0f}{err}")
        lines.append(f"| {r['deployment']} | {r['workload']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    errors = [r[f"{m}_{s}"]["error"] for r in table for m, s in METRICS]
    within = [abs(e) <= 0.15 for e in errors if e is not None]
    lines.append(f"\n{sum(within)} of {len(within)} predictions within 15% of measured.")
    return "\n".join(lines)


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    markers = {"colocated": "o", "1p1d": "s"}
    colors = {"p50": "tab:blue", "p90": "tab:orange"}
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        values = []
        for r in table:
            for stat in ("p50", "p90"):
                c = r[f"{metric}_{stat}"]
                values += [c["measured"], c["predicted"]]
                ax.scatter(c["measured"], c["predicted"], marker=markers[r["deployment"]], color=colors[stat],
                           alpha=0.8, label=f"{r['deployment']} {stat}")
        lo, hi = min(values) * 0.8, max(values) * 1.25
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15,
                        label="±15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, and none on the minor ticks (they overlap)
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"measured {metric.upper()} (ms)")
        ax.set_ylabel(f"predicted {metric.upper()} (ms)")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("Simulator vs the live server (calibrated from tandem profile alone)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/sim"))
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="one rate per workload, 12 requests")
    p.add_argument("--reuse-profiles", action="store_true")
    p.add_argument("--skip-measure", action="store_true", help="only simulate (the measured files exist)")
    add_server_args(p, None)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    deps = [d for d in args.deployments.split(",") if d]
    workloads = [w for w in args.workloads.split(",") if w]
    num_prompts = 12 if args.quick else args.num_prompts

    def rates_of(dep: str, workload: str) -> list[float]:
        rates = WORKLOADS[workload]["rates"][dep]
        return rates[:1] if args.quick else rates

    profiles = {name: run_profile(name, args.out_dir, args.reuse_profiles)
                for name in {DEPLOYMENTS[d]["profile"] for d in deps}}
    if not args.skip_measure:
        for dep in deps:
            measure(dep, workloads, num_prompts, args, rates_of)
    for dep in deps:
        for workload in workloads:
            for rate in rates_of(dep, workload):
                simulate(dep, workload, rate, num_prompts, profiles[DEPLOYMENTS[dep]["profile"]], args.out_dir)
    table = rows(args.out_dir, deps, workloads, rates_of)
    (args.out_dir / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    text = markdown(table)
    (args.out_dir / "summary.md").write_text(text + "\n")
    plot(table, args.out_dir / "simulator.png")
    print(text)
    print(f"\nplot: {args.out_dir / 'simulator.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
