"""The SLO planner against static splits of the same two cores, on a trace whose mix shifts (issues #16, #34).

    .venv/bin/python benchmarks/planner.py            # the full run (about 25 min on 2 cores, the profile included)
    .venv/bin/python benchmarks/planner.py --quick    # a smoke check (a few minutes)
    .venv/bin/python benchmarks/planner.py --seed 1 --reuse-profile --configs cc,cd,planner   # another trace

One trace (Mooncake format, generated from --seed into benchmarks/results/planner_trace.jsonl, Poisson arrivals), in
phases of --phase-s seconds each, in the order --phases:
  prefill   long prompts, short answers: --prefill-input tokens in, --prefill-output out, at --prefill-rate req/s
  decode    short prompts, long answers: --decode-input in, --decode-output out, at --decode-rate req/s
Every configuration is a fresh `tandem serve` (default model, dtype auto, two workers of one core each behind the
router, the same SLOs --slo-ttft-ms / --slo-tpot-ms for the per-request path choice) replaying the same trace with
the project's own client (`tandem bench serve`, ignore_eos):
  cc        --workers 2: two colocated workers (each prefills and decodes)
  cd        --workers 1 --decode-workers 1: one colocated worker, one decode worker
  pd        --prefill-workers 1 --decode-workers 1
  planner   cc with --planner on and --planner-profile (--planner-interval, --planner-window, --planner-dwell): it
            predicts each move's goodput with the simulator and flips a worker along decode <-> colocated when one wins
  reactive  (not run by default) cc with --planner on and no profile: the planner that reacts to SLO misses
The planner's profile is a worker's engine as the deployment pins it (`tandem profile --cores 0 --num-threads 1
--serve-args "--workers 2"`, about 5 min), made once into the results directory (--reuse-profile keeps it, or
--planner-profile names one).
Goodput: requests that met both SLOs (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms) per second of the trace,
overall and per phase. While each configuration runs, the router's /metrics are sampled every second (worker_up per
worker and role; router_planner_flips_total), which gives the roles over time.
At the end of the planner's run its predictions are read from /v1/cluster (waiting for the last action's horizon to
be measured): each action's predicted goodput against the goodput then measured.
Goal: the planner's goodput at least 1.2x the best static split's, with its actions plotted over time against TTFT
and ITL; predicted against measured goodput within 20% for its own actions.
Results: benchmarks/results/planner.json, the plot docs/planner.png; per-run records and logs under
benchmarks/results/planner/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from kv_store_common import fmt, pct, ratio
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from server_process import RunFailed, add_server_args, bench_serve, scrape, serving, tandem_exe

from tandem.bench.report import load_records

console = Console()
ROOT = Path(__file__).resolve().parent
CONFIGS = {
    "cc": ["--workers", "2"],
    "cd": ["--workers", "1", "--decode-workers", "1"],
    "pd": ["--prefill-workers", "1", "--decode-workers", "1"],
    "planner": ["--workers", "2", "--planner", "on"],
    "reactive": ["--workers", "2", "--planner", "on"],
}
PLANNERS = ("planner", "reactive")


def make_trace(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    """Rows of the trace, and the phase each arrival belongs to (written without it, as Mooncake's format)."""
    rng = np.random.default_rng(args.seed)
    rows, t0 = [], 0.0
    for name in args.phases.split(","):
        rate = getattr(args, f"{name}_rate")
        t = t0 + rng.exponential(1 / rate)
        while t < t0 + args.phase_s:
            rows.append({"timestamp": round(t * 1000), "input_length": getattr(args, f"{name}_input"),
                         "output_length": getattr(args, f"{name}_output"), "hash_ids": [], "phase": name})
            t += rng.exponential(1 / rate)
        t0 += args.phase_s
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "phase"}) + "\n" for r in rows))
    return rows


class Sampler(threading.Thread):
    """Every second: which workers are up in which role, and the planner's flips so far."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                m = scrape(self.url, by=("role", "to_role"))
            except Exception:  # a scrape during a restart: the next one will do
                continue
            roles = {role: m.get(("tandem:worker_up", role), 0.0) for role in ("prefill", "decode", "colocated")}
            flips = sum(v for (name, _), v in m.items() if name == "tandem:router_planner_flips_total")
            self.samples.append({"t": time.time(), "roles": roles, "flips": flips})


def summarize(records_path: Path, trace: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    records = sorted(load_records(records_path), key=lambda r: r.index)
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    duration = args.phase_s * len(args.phases.split(","))
    rows = []
    for r, row in zip(records, trace, strict=False):
        tpot = r.tpot
        met = r.success and r.ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot)
        rows.append({"start": r.start, "phase": row["phase"], "ok": r.success, "met": met, "ttft": r.ttft,
                     "tpot": tpot, "itl_p99_ms": pct(r.itl, 99)})
    out: dict[str, Any] = {"requests": len(rows), "failed": sum(not x["ok"] for x in rows),
                           "goodput": sum(x["met"] for x in rows) / duration, "rows": rows}
    for phase in args.phases.split(","):
        part = [x for x in rows if x["phase"] == phase]
        ok = [x for x in part if x["ok"]]
        out[phase] = {
            "goodput": sum(x["met"] for x in part) / args.phase_s,
            "slo_met": sum(x["met"] for x in part) / len(part) if part else None,
            "ttft_p50_ms": pct([x["ttft"] for x in ok], 50),  # pct: seconds in, milliseconds out
            "ttft_p90_ms": pct([x["ttft"] for x in ok], 90),
            "tpot_p50_ms": pct([x["tpot"] for x in ok if x["tpot"] is not None], 50),
            "tpot_p90_ms": pct([x["tpot"] for x in ok if x["tpot"] is not None], 90),
        }
    return out


def run_config(name: str, args: argparse.Namespace, trace_path: Path, trace: list[dict[str, Any]],
               progress: Progress) -> dict[str, Any]:
    flags = [*CONFIGS[name], "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    if name in PLANNERS:
        flags += ["--planner-interval", str(args.planner_interval), "--planner-window", str(args.planner_window),
                  "--planner-dwell", str(args.planner_dwell)]
    if name == "planner":
        flags += ["--planner-profile", str(args.planner_profile), "--planner-margin", str(args.planner_margin)]
    view = None
    with serving(name, flags, args, progress) as server:
        sampler = Sampler(server.url)
        sampler.start()
        try:
            bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--dataset-name", "mooncake_trace",
                         "--dataset-path", str(trace_path), "--num-prompts", str(len(trace)), "--ignore-eos",
                         "--save-result", "--result-dir", str(args.out_dir), "--result-filename", f"{name}.json",
                         "--disable-tqdm", "--request-timeout", "900"],
                        args.out_dir / f"{name}.client.log", progress, f"{name}: replaying {len(trace)} requests")
            if name == "planner":
                view = settled_planner_view(server.url, args.planner_dwell + 60, progress)
        finally:
            sampler.stop.set()
            sampler.join()
    out = summarize(args.out_dir / f"{name}.requests.jsonl", trace, args)
    if view is not None:
        out["planner_view"] = view
    # The client's result is stamped when the run ended (to the second): its start is that less its duration.
    client = json.loads((args.out_dir / f"{name}.json").read_text())
    origin = time.mktime(time.strptime(client["date"], "%Y%m%d-%H%M%S")) - client["duration"]
    out["timeline"] = [{**s, "t": s["t"] - origin} for s in sampler.samples]
    return out


def settled_planner_view(url: str, patience_s: float, progress: Progress) -> dict[str, Any]:
    """/v1/cluster's planner once its actions' predictions are measured (or patience runs out)."""
    task = progress.add_task("planner: waiting for its last action's horizon to be measured", total=None)
    deadline = time.monotonic() + patience_s
    while True:
        view = httpx.get(f"{url}/v1/cluster", timeout=30).json()["planner"]
        pending = [r for r in view.get("predictions", []) if r["acted"] and r["measured_goodput"] is None]
        if not pending or time.monotonic() > deadline:
            progress.remove_task(task)
            return view
        time.sleep(2)


def prediction_rows(results: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The planner's actions: predicted and measured goodput, and whether the horizon ended within the trace
    (one that runs past its end counts arrivals that never came)."""
    run = results["runs"].get("planner", {})
    view, timeline = run.get("planner_view"), run.get("timeline", [])
    if not view or not timeline:
        return []
    duration = args.phase_s * len(args.phases.split(","))
    # Ages are from the moment the view was read, which is after the last timeline sample.
    read_at = timeline[-1]["t"]
    rows = []
    for r in view.get("predictions", []):
        start = read_at - r["age_s"]
        rows.append({**r, "start_s": start, "within_trace": start + r["horizon_s"] <= duration})
    return rows


def tables(results: dict[str, Any], phases: list[str]) -> Table:
    t = Table(title="goodput (req/s meeting both SLOs) and latency, per phase")
    phase_cols = [f"{p}: goodput / SLO met / TTFT p90 / TPOT p90" for p in phases]
    for col in ["config", "goodput", "vs best static", *phase_cols, "failed"]:
        t.add_column(col, justify="right")
    runs = results["runs"]
    best = results.get("best_static")
    for name, run in runs.items():
        cells = [name, fmt(run["goodput"], ".3f"), fmt(ratio(run["goodput"], runs[best]["goodput"]) if best else None,
                                                        ".2f")]
        for p in phases:
            s = run[p]
            met = fmt(100 * s["slo_met"] if s["slo_met"] is not None else None)
            cells.append(f"{fmt(s['goodput'], '.3f')} / {met}% / {fmt(s['ttft_p90_ms'])} / {fmt(s['tpot_p90_ms'])}")
        cells.append(str(run["failed"]))
        t.add_row(*cells)
    return t


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    shown = [n for n in ("planner", results.get("best_static")) if n in runs]
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    colors = {"planner": "tab:blue", "cc": "tab:red", "cd": "tab:green", "pd": "tab:orange"}
    edges = [args.phase_s * i for i in range(1, len(args.phases.split(",")))]
    for name in shown:
        rows = [x for x in runs[name]["rows"] if x["ok"]]
        c = colors.get(name)
        axes[0].scatter([x["start"] for x in rows], [x["ttft"] for x in rows], s=8, color=c, label=name)
        axes[1].scatter([x["start"] for x in rows if x["tpot"]], [1000 * x["tpot"] for x in rows if x["tpot"]], s=8,
                        color=c, label=name)
        itl = [x for x in rows if x["itl_p99_ms"]]
        axes[2].scatter([x["start"] for x in itl], [x["itl_p99_ms"] for x in itl], s=8, color=c, label=name)
    axes[0].axhline(args.slo_ttft_ms / 1000, color="k", ls="--", lw=1, label="SLO")
    axes[1].axhline(args.slo_tpot_ms, color="k", ls="--", lw=1, label="SLO")
    for ax, label in zip(axes[:3], ("TTFT (s)", "TPOT (ms)", "a request's ITL p99 (ms)"), strict=True):
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    timeline = runs.get("planner", {}).get("timeline", [])
    ax = axes[3]
    for role, c in (("colocated", "tab:purple"), ("decode", "tab:green"), ("prefill", "tab:orange")):
        ax.step([s["t"] for s in timeline], [s["roles"][role] for s in timeline], where="post", color=c, label=role)
    flips = [s["t"] for i, s in enumerate(timeline) if i and s["flips"] > timeline[i - 1]["flips"]]
    for ax_ in axes:
        for x in edges:
            ax_.axvline(x, color="gray", ls=":", lw=1)
        for x in flips:
            ax_.axvline(x, color="tab:blue", lw=1, alpha=0.6)
    ax.set_ylabel("planner: workers up by role")
    ax.set_xlabel("seconds into the trace (dotted: phase change; blue: a planner flip)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.suptitle(f"planner vs best static split ({results.get('best_static')}); phases {args.phases}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short phases: a smoke check")
    p.add_argument("--configs", default="cc,cd,pd,planner")
    p.add_argument("--phases", default="prefill,decode")
    p.add_argument("--phase-s", type=float, default=120.0)
    p.add_argument("--prefill-input", type=int, default=768)
    p.add_argument("--prefill-output", type=int, default=8)
    p.add_argument("--prefill-rate", type=float, default=0.3)
    p.add_argument("--decode-input", type=int, default=64)
    p.add_argument("--decode-output", type=int, default=192)
    p.add_argument("--decode-rate", type=float, default=0.5)
    p.add_argument("--slo-ttft-ms", type=float, default=6000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--planner-interval", type=float, default=2.0)
    p.add_argument("--planner-window", type=float, default=20.0)
    p.add_argument("--planner-dwell", type=float, default=30.0)
    p.add_argument("--planner-margin", type=float, default=0.1)
    p.add_argument("--planner-profile", type=Path, default=None,
                   help="the predictive planner's profile (default: made into the results directory)")
    p.add_argument("--reuse-profile", action="store_true", help="keep the profile an earlier run made")
    p.add_argument("--seed", type=int, default=0)
    add_server_args(p, ROOT / "results" / "planner", "warning")
    p.add_argument("--plot-path", type=Path, default=ROOT.parent / "docs" / "planner.png")
    args = p.parse_args()
    if args.quick:
        args.phase_s = 40.0
    return args


def worker_profile(args: argparse.Namespace) -> Path:
    path = args.out_dir / "worker_profile.json"
    if args.reuse_profile and path.exists():
        return path
    console.print("[bold]profile[/]: a worker's engine, one core and one thread, behind --workers 2 (about 5 min)")
    with (args.out_dir / "profile.log").open("w") as log:
        subprocess.run([tandem_exe(), "profile", "--cores", "0", "--num-threads", "1", "--serve-args", "--workers 2",
                        "-o", str(path)], check=True, stdout=log, stderr=subprocess.STDOUT)
    return path


def main() -> int:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if "planner" in args.configs.split(",") and args.planner_profile is None:
        args.planner_profile = worker_profile(args)
    trace_path = ROOT / "results" / "planner_trace.jsonl"
    trace = make_trace(args, trace_path)
    console.print(f"trace: {len(trace)} requests over {args.phase_s * len(args.phases.split(',')):.0f} s "
                  f"({args.phases}) -> {trace_path}")
    results: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "runs": {}}
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console)
    with progress:
        for name in args.configs.split(","):
            try:
                results["runs"][name] = run_config(name, args, trace_path, trace, progress)
            except RunFailed as e:
                console.print(f"[red]{name} failed: {e}[/]\n{e.detail}")
    static = [n for n in results["runs"] if n not in PLANNERS]
    if static:
        results["best_static"] = max(static, key=lambda n: results["runs"][n]["goodput"])
    phases = args.phases.split(",")
    console.print(tables(results, phases))
    if "planner" in results["runs"] and static:
        best = results["best_static"]
        results["planner_over_best_static"] = ratio(results["runs"]["planner"]["goodput"],
                                                    results["runs"][best]["goodput"])
        console.print(f"planner / best static ({best}) goodput: {fmt(results['planner_over_best_static'], '.2f')} "
                      "(goal >= 1.2)")
    results["predictions"] = prediction_rows(results, args)
    for r in results["predictions"]:
        err = "" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        console.print(f"  t={r['start_s']:.0f} s {'acted' if r['acted'] else 'stayed'}: {r['label']}: predicted "
                      f"{r['predicted_goodput']:.3f} req/s, measured {fmt(r['measured_goodput'], '.3f')} {err}"
                      f"{'' if r['within_trace'] else ' (horizon past the trace end)'}")
    out = ROOT / "results" / "planner.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results, args, args.plot_path)
    console.print(f"wrote {out} and {args.plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
