"""The simulator against the live server (issues #19, #34): predicted vs measured TTFT and TPOT (p50, p90)
for a colocated server, the same with speculative decoding (ngram, on copy-heavy prompts), a 1P1D deployment
with every prompt through the pair, and a 1P1D deployment under the router's default per-request path
choice, at two or three request rates, the simulator calibrated from `tandem profile` alone (the
speculative runs also feed it the acceptance the server counted in that run).

    .venv/bin/python benchmarks/simulator.py                  # the full run (~60 min)
    .venv/bin/python benchmarks/simulator.py --quick          # a smoke check (one rate, few requests)
    .venv/bin/python benchmarks/simulator.py --reuse-profiles # keep the profiles of an earlier run

Each point is measured `--repeats` times (2), each on a fresh server with the same prompts and arrivals: the
prediction's error is against their mean, and their spread ((max - min) / mean) is the machine's own repeat
noise; a point is within when its error is within 15% or within that spread.

Profiles: the colocated engine as `tandem serve` runs it (every core), and a worker's engine as a local 1P1D
deployment pins it (one core, one thread; with the co-location term: its steps beside a neighbour engine on
the other core). The server's API process, and the benchmark client, share the cores with the engine: the
serving calibration sees them, the step profile does not.
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
from server_process import (
    PER_POSITION,
    SPEC,
    add_server_args,
    bench_serve,
    counter_delta,
    scrape,
    serving,
    tandem_exe,
)

console = Console(stderr=True)
RatesOf = Callable[[str, str], list[float]]
METRICS = [("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90")]

DISAGG = ["--prefill-workers", "1", "--decode-workers", "1", "--worker-cores", "0", "1"]
NGRAM = json.dumps({"method": "ngram"})
# Admission off: the simulator serves every request; a server refusing some (429) would serve a lighter load.
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "colocated": {"serve": ["--admission", "off"], "sim": ["--deployment", "1C"], "profile": "colocated",
                  "workloads": ["random", "chat"]},
    "colocated-spec": {"serve": ["--admission", "off", "--speculative-config", NGRAM], "sim": ["--deployment", "1C"],
                       "profile": "colocated", "workloads": ["copy"], "spec": True},
    "1p1d": {"serve": [*DISAGG, "--path-policy", "disaggregated"],
             "sim": ["--deployment", "1P1D", "--path-policy", "disaggregated"], "profile": "worker",
             "workloads": ["random", "chat"]},
    # The router's default: each request's path by its predicted TTFT and TPOT.
    "1p1d-slo": {"serve": DISAGG, "sim": ["--deployment", "1P1D", "--path-policy", "slo"], "profile": "worker",
                 "workloads": ["chat"]},
}
# The serving calibration runs each profile's engine as the deployment runs it: the colocated server, and
# the 1P1D deployment itself (its router shares the two cores with the workers).
PROFILES = {"colocated": [],
            "worker": ["--cores", "0", "--num-threads", "1", "--serve-args", " ".join([*DISAGG, "--path-policy",
                                                                                      "disaggregated"])]}
WORKLOADS: dict[str, dict[str, Any]] = {
    "random": {"flags": ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64"],
               "rates": {"colocated": [0.3, 0.6], "1p1d": [0.15, 0.3]}, "seed": 11},
    "chat": {"flags": ["--dataset-name", "synthetic_chat"],
             "rates": {"colocated": [0.4, 0.8], "1p1d": [0.2, 0.4], "1p1d-slo": [0.2, 0.4]}, "seed": 23},
    "copy": {"flags": ["--dataset-name", "copy", "--copy-input-len", "512", "--copy-output-len", "128"],
             "rates": {"colocated-spec": [0.3, 0.6]}, "seed": 31},
}
GENERATED, REQUESTS = "tandem:generation_tokens_total", "tandem:request_success_total"


def run_profile(name: str, out_dir: Path, reuse: bool) -> Path:
    path = out_dir / f"{name}.json"
    if reuse and path.exists():
        return path
    console.print(f"[bold]profile {name}[/]")
    subprocess.run([tandem_exe(), "profile", *PROFILES[name], "-o", str(path)], check=True)
    return path


def result_path(out_dir: Path, kind: str, dep: str, workload: str, rate: float, rep: int = 0) -> Path:
    suffix = f"-r{rep}" if kind == "measured" else ""
    return out_dir / f"{kind}-{dep}-{workload}-{rate:g}{suffix}.json"


def common_flags(workload: str, rate: float, num_prompts: int) -> list[str]:
    """A seed per workload and rate: no two runs against one server share prompts (the prefix cache would
    hide their prefill), and the simulator replays each run's own prompts and arrivals."""
    w = WORKLOADS[workload]
    seed = w["seed"] + 1000 * round(rate * 100)
    return [*w["flags"], "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--metric-percentiles", "50,90", "--save-result"]


def spec_counters(before: dict, after: dict) -> dict[str, Any]:
    """What the server counted of speculation over one run (its warm-ups included: a few short requests)."""
    drafts, tokens, accepted = (counter_delta(before, after, m) for m in SPEC)
    per_pos = [counter_delta(before, after, PER_POSITION, str(i)) for i in range(64)]
    while per_pos and per_pos[-1] == 0:
        per_pos.pop()
    generated = counter_delta(before, after, GENERATED)
    finished = sum(v for (name, _), v in after.items() if name == REQUESTS) - \
        sum(v for (name, _), v in before.items() if name == REQUESTS)
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted": accepted, "accepted_per_pos": per_pos,
            "decode_rows": generated - accepted - finished}


def measure(dep: str, num_prompts: int, args: argparse.Namespace, rates_of: RatesOf, rep: int) -> None:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, serving(dep, DEPLOYMENTS[dep]["serve"], args,
                                                                   progress) as server:
        for workload in DEPLOYMENTS[dep]["workloads"]:
            for rate in rates_of(dep, workload):
                out = result_path(args.out_dir, "measured", dep, workload, rate, rep)
                flags = [tandem_exe(), "bench", "serve", "--base-url", server.url, "--ignore-eos", "--disable-tqdm",
                         "--num-warmups", "2", *common_flags(workload, rate, num_prompts), "--result-dir",
                         str(out.parent), "--result-filename", out.name, "--label", f"measured {dep}"]
                before = scrape(server.url, by=("position",))
                bench_serve(flags, args.out_dir / f"{dep}.client.log", progress,
                            f"{dep} {workload} @ {rate:g}/s (repeat {rep + 1})")
                if DEPLOYMENTS[dep].get("spec"):
                    counted = spec_counters(before, scrape(server.url, by=("position",)))
                    out.with_suffix(".spec.json").write_text(json.dumps(counted) + "\n")


def spec_flags(out_dir: Path, dep: str, workload: str, rate: float, repeats: int) -> list[str]:
    """The acceptance the server counted, over the point's repeats, as the simulator's draft model."""
    from tandem.sim.speculation import SpecModel

    runs = [json.loads(result_path(out_dir, "measured", dep, workload, rate, r).with_suffix(".spec.json").read_text())
            for r in range(repeats)]
    width = max(len(r["accepted_per_pos"]) for r in runs)
    per_pos = [sum(r["accepted_per_pos"][i] if i < len(r["accepted_per_pos"]) else 0 for r in runs)
               for i in range(width)]
    spec = SpecModel.from_counters(sum(r["num_drafts"] for r in runs), sum(r["num_draft_tokens"] for r in runs),
                                   per_pos, sum(r["decode_rows"] for r in runs))
    if spec is None:
        return []
    return ["--spec-draft-tokens", str(spec.draft_tokens), "--spec-acceptance",
            ",".join(f"{a:.4f}" for a in spec.accept), "--spec-draft-rate", f"{spec.draft_rate:.4f}"]


def simulate(dep: str, workload: str, rate: float, num_prompts: int, profile: Path, out_dir: Path,
             repeats: int) -> None:
    out = result_path(out_dir, "predicted", dep, workload, rate)
    extra = spec_flags(out_dir, dep, workload, rate, repeats) if DEPLOYMENTS[dep].get("spec") else []
    subprocess.run([tandem_exe(), "bench", "sim", "--profile", str(profile), *DEPLOYMENTS[dep]["sim"], *extra,
                    *common_flags(workload, rate, num_prompts), "--result-dir", str(out.parent),
                    "--result-filename", out.name, "--label", f"predicted {dep}"], check=True,
                   stdout=subprocess.DEVNULL)


def rows(out_dir: Path, deps: list[str], rates_of: RatesOf, repeats: int) -> list[dict[str, Any]]:
    table = []
    for dep in deps:
        for workload in DEPLOYMENTS[dep]["workloads"]:
            for rate in rates_of(dep, workload):
                runs = [json.loads(result_path(out_dir, "measured", dep, workload, rate, r).read_text())
                        for r in range(repeats)]
                predicted = json.loads(result_path(out_dir, "predicted", dep, workload, rate).read_text())
                row: dict[str, Any] = {"deployment": dep, "workload": workload, "rate": rate,
                                       "completed": min(r["completed"] for r in runs)}
                for metric, stat in METRICS:
                    key = f"{'median' if stat == 'p50' else stat}_{metric}_ms"
                    values = [r[key] for r in runs]
                    m, p = sum(values) / len(values), predicted[key]
                    spread = (max(values) - min(values)) / m if m else 0.0
                    error = (p - m) / m if m else None
                    row[f"{metric}_{stat}"] = {"measured": m, "runs": values, "spread": spread, "predicted": p,
                                               "error": error,
                                               "within": error is not None and abs(error) <= max(0.15, spread)}
                table.append(row)
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    head = "| deployment | workload | rate | " + " | ".join(f"{m.upper()} {s} meas / pred (err; spread)"
                                                          for m, s in METRICS)
    lines = [head + " |", "|" + "---|" * (3 + len(METRICS))]
    for r in table:
        cells = []
        for metric, stat in METRICS:
            c = r[f"{metric}_{stat}"]
            err = "" if c["error"] is None else f" ({c['error'] * 100:+.0f}%; {c['spread'] * 100:.0f}%)"
            cells.append(f"{c['measured']:.0f} / {c['predicted']:.0f}{err}")
        lines.append(f"| {r['deployment']} | {r['workload']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    cells = [r[f"{m}_{s}"] for r in table for m, s in METRICS if r[f"{m}_{s}"]["error"] is not None]
    in15 = sum(abs(c["error"]) <= 0.15 for c in cells)
    within = sum(c["within"] for c in cells)
    lines.append(f"\n{in15} of {len(cells)} predictions within 15% of measured; {within} of {len(cells)} within "
                 "15% or the point's own repeat spread.")
    return "\n".join(lines)


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    markers = {"colocated": "o", "colocated-spec": "^", "1p1d": "s", "1p1d-slo": "D"}
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
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="measured runs per point, each on a fresh server")
    p.add_argument("--rate-scale", type=float, default=1.0, help="every rate times this (a slower machine)")
    p.add_argument("--rates", default="all", choices=["all", "low", "high"], help="every rate of a point, or one")
    p.add_argument("--quick", action="store_true", help="one rate per workload, 12 requests, one repeat")
    p.add_argument("--reuse-profiles", action="store_true")
    p.add_argument("--skip-measure", action="store_true", help="only simulate (the measured files exist)")
    add_server_args(p, None)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    deps = [d for d in args.deployments.split(",") if d]
    num_prompts = 12 if args.quick else args.num_prompts
    repeats = 1 if args.quick else args.repeats

    def rates_of(dep: str, workload: str) -> list[float]:
        rates = WORKLOADS[workload]["rates"][dep if dep in WORKLOADS[workload]["rates"] else dep.split("-")[0]]
        rates = [round(r * args.rate_scale, 3) for r in rates]
        return rates[:1] if args.quick or args.rates == "low" else rates[-1:] if args.rates == "high" else rates

    profiles = {name: run_profile(name, args.out_dir, args.reuse_profiles)
                for name in {DEPLOYMENTS[d]["profile"] for d in deps}}
    if not args.skip_measure:
        for rep in range(repeats):  # a fresh server per repeat: the same prompts find nothing cached
            for dep in deps:
                measure(dep, num_prompts, args, rates_of, rep)
    for dep in deps:
        for workload in DEPLOYMENTS[dep]["workloads"]:
            for rate in rates_of(dep, workload):
                simulate(dep, workload, rate, num_prompts, profiles[DEPLOYMENTS[dep]["profile"]], args.out_dir,
                         repeats)
    table = rows(args.out_dir, deps, rates_of, repeats)
    (args.out_dir / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    text = markdown(table)
    (args.out_dir / "summary.md").write_text(text + "\n")
    plot(table, args.out_dir / "simulator.png")
    print(text)
    print(f"\nplot: {args.out_dir / 'simulator.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
