"""Prefill/decode disaggregation (issue #6): two colocated servers against one prefill and one decode worker, on
the same long-plus-short workload, in one run so the ratios are side by side.

    .venv/bin/python benchmarks/disaggregation.py                                  # the full run
    .venv/bin/python benchmarks/disaggregation.py --configs colocated-chunked --quick   # a smoke check

Configurations (each a fresh `tandem serve` on a free loopback port; `--server-args` is appended to all):
    colocated-chunked   --max-num-batched-tokens 512 (chunked prefill is on by default)
    colocated-nochunk   --no-enable-chunked-prefill --max-num-batched-tokens 4096
    1p1d                --prefill-workers 1 --decode-workers 1 --worker-cores 0 1 --max-num-batched-tokens 512
    1p1d-tuned          1p1d, with --prefill-worker-args "--max-num-batched-tokens 1024
                        --long-prefill-token-threshold 512" (short prompts share the prefill worker's steps)

For each: the unloaded TPOT (random 256 in / 128 out, one request at a time), then the long_short mix (10% of
prompts 2,048 tokens, the rest 256; 128 output tokens each) at each `--rates` request rate. A request meets the
SLO when its TTFT <= 3,000 ms and its TPOT <= 3x colocated-chunked's unloaded TPOT; goodput is computed here from
the per-request records, so every configuration is held to the same SLO.
The benchmark client and the server's HTTP front end share the machine's cores with the engine.
Results: benchmarks/results/disaggregation/ (per-run JSON and records, server logs, summary.md, summary.json and
disaggregation.png).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from server_process import RunFailed, bench_serve, free_port, stop_server, tandem_exe, wait_healthy

from tandem.bench.metrics import meets_slos
from tandem.bench.report import load_records, result_paths

console = Console(stderr=True)

CONFIGS: dict[str, list[str]] = {
    "colocated-chunked": ["--max-num-batched-tokens", "512"],
    "colocated-nochunk": ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"],
    "1p1d": ["--prefill-workers", "1", "--decode-workers", "1", "--worker-cores", "0", "1",
             "--max-num-batched-tokens", "512"],
    # The prefill pool tuned for its phase: a larger budget, so short prompts share steps with a long one
    # (which gets at most 512 tokens a step) instead of queueing behind it.
    "1p1d-tuned": ["--prefill-workers", "1", "--decode-workers", "1", "--worker-cores", "0", "1",
                   "--max-num-batched-tokens", "512",
                   "--prefill-worker-args", "--max-num-batched-tokens 1024 --long-prefill-token-threshold 512"],
}
BASELINE = "colocated-chunked"
DISAGG = "1p1d"
# Seeds are per workload, not per config: every config sees the same prompts and arrivals at a rate, and no
# two runs against one server share prompts (with one seed they would, and the prefix cache would hide prefill).
UNLOADED_SEED = 1000
RATE_SEED = 0


@dataclass
class Mix:
    """The long_short workload, every flag given explicitly (the client's defaults are 5%, 4,096 in, 16 out)."""

    long_fraction: float = 0.10
    long_input_len: int = 2048
    long_output_len: int = 128
    short_input_len: int = 256
    short_output_len: int = 128

    def flags(self) -> list[str]:
        return ["--dataset-name", "long_short", "--long-short-long-fraction", str(self.long_fraction),
                "--long-short-long-input-len", str(self.long_input_len),
                "--long-short-long-output-len", str(self.long_output_len),
                "--long-short-short-input-len", str(self.short_input_len),
                "--long-short-short-output-len", str(self.short_output_len)]


@dataclass
class Slo:
    ttft_ms: float
    tpot_ms: float | None
    source: str  # how tpot_ms was chosen, for the report

    def as_goodput(self) -> dict[str, float]:
        return {"ttft": self.ttft_ms} | ({} if self.tpot_ms is None else {"tpot": self.tpot_ms})


@dataclass
class ConfigOutcome:
    name: str
    command: list[str]
    ok: bool = False
    error: str | None = None
    unloaded_tpot_ms: float | None = None
    results: dict[float, Path] = field(default_factory=dict)  # request rate -> the client's result JSON


@dataclass
class Row:
    config: str
    rate: float
    completed: int
    failed: int
    goodput: float | None  # requests per second meeting the SLO
    slo_attainment: float | None  # share of sent requests meeting the SLO
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p99_ms: float
    short_itl_p99_ms: float | None  # the stall disaggregation should remove: short decodes behind long prefills
    output_throughput: float


def run_config(name: str, args: argparse.Namespace, rates: list[float], num_prompts: int, mix: Mix,
               out_dir: Path, progress: Progress) -> ConfigOutcome:
    exe = tandem_exe()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [exe, "serve", "--port", str(port), *CONFIGS[name], *shlex.split(args.server_args)]
    outcome = ConfigOutcome(name, command)
    server_log = out_dir / f"{name}.server.log"
    client_log = out_dir / f"{name}.client.log"
    client_log.write_text("")
    common = [exe, "bench", "serve", "--base-url", url, "--ignore-eos", "--save-result", "--result-dir",
              str(out_dir), "--disable-tqdm"]
    console.print(f"[bold]{name}[/]: {shlex.join(command)}")
    with server_log.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, url, args.startup_timeout, server_log, progress, name)
        unloaded = out_dir / f"{name}-unloaded.json"
        bench_serve([*common, "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
                     "--max-concurrency", "1", "--num-prompts", str(args.unloaded_prompts), "--num-warmups", "2",
                     "--seed", str(UNLOADED_SEED), "--label", f"{name} unloaded", "--result-filename",
                     unloaded.name], client_log, progress, f"{name}: unloaded TPOT ({args.unloaded_prompts} prompts)")
        outcome.unloaded_tpot_ms = float(json.loads(unloaded.read_text())["median_tpot_ms"])
        console.print(f"  unloaded TPOT {outcome.unloaded_tpot_ms:.1f} ms")
        for i, rate in enumerate(rates):
            path = out_dir / f"{name}-rate{rate:g}.json"
            bench_serve([*common, *mix.flags(), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
                         "--seed", str(RATE_SEED + i), "--label", f"{name} @ {rate:g} req/s", "--result-filename",
                         path.name], client_log, progress,
                        f"{name}: {num_prompts} prompts at {rate:g} req/s (~{num_prompts / rate:.0f} s of arrivals)")
            outcome.results[rate] = path
        outcome.ok = True
    except RunFailed as e:
        outcome.error = str(e)
        console.print(f"[red]{name} failed[/]: {e}\n{e.detail}")
    finally:
        stop_server(proc)
    return outcome


def choose_slo(args: argparse.Namespace, outcomes: list[ConfigOutcome]) -> Slo:
    if args.slo_tpot_ms is not None:
        return Slo(args.slo_ttft_ms, args.slo_tpot_ms, "given (--slo-tpot-ms)")
    measured = {o.name: o.unloaded_tpot_ms for o in outcomes if o.unloaded_tpot_ms is not None}
    if BASELINE in measured:
        tpot = measured[BASELINE]
        return Slo(args.slo_ttft_ms, 3 * tpot, f"3x {BASELINE}'s unloaded TPOT ({tpot:.1f} ms)")
    if measured:
        # Still one SLO for every config, only anchored elsewhere; the report says so.
        name, tpot = next(iter(measured.items()))
        return Slo(args.slo_ttft_ms, 3 * tpot, f"3x {name}'s unloaded TPOT ({tpot:.1f} ms; {BASELINE} not measured)")
    return Slo(args.slo_ttft_ms, None, "no unloaded TPOT measured: TTFT only")


def make_row(name: str, rate: float, path: Path, slo: Slo) -> Row:
    result = json.loads(path.read_text())
    records = load_records(result_paths(result, str(path.parent), path.name)["records"])
    goodput = slo.as_goodput()
    met = sum(meets_slos(r, goodput) for r in records)
    short = (result.get("by_category") or {}).get("short")
    return Row(name, rate, result["completed"], result["failed"], met / result["duration"],
               met / len(records) if records else None, result["median_ttft_ms"], result["p99_ttft_ms"],
               result["median_tpot_ms"], result["p99_tpot_ms"], result["p99_itl_ms"],
               short["p99_itl_ms"] if short else None, result["output_throughput"])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Each disaggregated config over colocated-chunked at each rate both reached: ITL p99 below 1 and goodput
    above 1 favour disaggregation."""
    by = {(r.config, r.rate): r for r in rows}
    out = []
    for name in [n for n in CONFIGS if n.startswith(DISAGG)]:
        for rate in sorted({r.rate for r in rows}):
            d, c = by.get((name, rate)), by.get((BASELINE, rate))
            if d and c:
                out.append({"config": name, "rate": rate, "itl_p99": ratio(d.itl_p99_ms, c.itl_p99_ms),
                            "short_itl_p99": ratio(d.short_itl_p99_ms, c.short_itl_p99_ms),
                            "goodput": ratio(d.goodput, c.goodput)})
    return out


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def md_table(header: list[str], body: list[list[str]]) -> str:
    # Numbers right-aligned, the first (name) column left.
    lines = ["| " + " | ".join(header) + " |", "|:---|" + "".join("---:|" for _ in header[1:])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def summary_markdown(rows: list[Row], outcomes: list[ConfigOutcome], slo: Slo, num_prompts: int) -> str:
    tpot = "no TPOT SLO" if slo.tpot_ms is None else f"TPOT <= {slo.tpot_ms:.1f} ms ({slo.source})"
    parts = [f"SLO: TTFT <= {slo.ttft_ms:.0f} ms and {tpot}. {num_prompts} prompts per rate.", ""]
    header = ["config", "rate", "completed", "goodput req/s", "SLO met", "TTFT p50", "TTFT p99", "TPOT p50",
              "TPOT p99", "ITL p99", "short ITL p99", "out tok/s"]
    body = [[r.config, f"{r.rate:g}", f"{r.completed}/{r.completed + r.failed}", fmt(r.goodput, ".3f"),
             fmt(r.slo_attainment, ".0%"), fmt(r.ttft_p50_ms), fmt(r.ttft_p99_ms), fmt(r.tpot_p50_ms, ".1f"),
             fmt(r.tpot_p99_ms, ".1f"), fmt(r.itl_p99_ms, ".1f"), fmt(r.short_itl_p99_ms, ".1f"),
             fmt(r.output_throughput, ".1f")] for r in rows]
    parts += [md_table(header, body), "", "(latencies in ms)"]
    unloaded = [f"{o.name} {o.unloaded_tpot_ms:.1f} ms" for o in outcomes if o.unloaded_tpot_ms is not None]
    if unloaded:
        parts += ["", "Unloaded TPOT (median, one request at a time): " + ", ".join(unloaded) + "."]
    rs = ratios(rows)
    if rs:
        parts += ["", f"Disaggregated / {BASELINE} (ITL below 1 and goodput above 1 favour disaggregation):", "",
                  md_table(["config", "rate", "ITL p99", "short ITL p99", "goodput"],
                           [[x["config"], f"{x['rate']:g}", fmt(x["itl_p99"], ".2f"), fmt(x["short_itl_p99"], ".2f"),
                             fmt(x["goodput"], ".2f")] for x in rs])]
    for o in outcomes:
        if not o.ok:
            parts += ["", f"{o.name}: FAILED ({o.error}; see {o.name}.server.log and {o.name}.client.log)"]
    return "\n".join(parts) + "\n"


def plot(rows: list[Row], slo: Slo, path: Path) -> None:
    """Goodput, ITL p99 and TTFT p99 against request rate, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("goodput", "goodput (req/s)"), ("itl_p99_ms", "ITL p99 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name in dict.fromkeys(r.config for r in rows):
        mine = sorted((r for r in rows if r.config == name), key=lambda r: r.rate)
        for ax, (attr, _) in zip(axes, panels, strict=True):
            ys = [getattr(r, attr) for r in mine]
            ax.plot([r.rate for r in mine], [math.nan if y is None else y for y in ys], marker="o", label=name)
    rates = sorted({r.rate for r in rows})
    axes[0].plot(rates, rates, ls=":", color="gray", label="offered rate")
    axes[2].axhline(slo.ttft_ms, ls="--", color="gray", label="TTFT SLO")
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle("prefill/decode disaggregation: long_short workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    console.print(f"plot: {path}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--rates", default="0.25,0.5,1.0", help="request rates (req/s) of the long_short runs")
    ap.add_argument("--num-prompts", type=int, default=40, help="long_short requests per rate")
    ap.add_argument("--unloaded-prompts", type=int, default=4, help="requests of the unloaded-TPOT run")
    ap.add_argument("--quick", action="store_true", help="one rate (0.5) of 6 prompts: a smoke check")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=None,
                    help="default: 3x colocated-chunked's unloaded TPOT, measured in this run")
    ap.add_argument("--server-args", default="", help="extra `tandem serve` flags for every config, one string")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--out-dir", default="benchmarks/results/disaggregation")
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    args.config_names = names
    return args


def main() -> int:
    args = parse_args()
    rates = [0.5] if args.quick else [float(r) for r in args.rates.split(",") if r.strip()]
    num_prompts = 6 if args.quick else args.num_prompts
    mix = Mix()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    outcomes: list[ConfigOutcome] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for name in args.config_names:
            outcomes.append(run_config(name, args, rates, num_prompts, mix, out_dir, progress))

    slo = choose_slo(args, outcomes)
    rows = [make_row(o.name, rate, path, slo) for o in outcomes for rate, path in o.results.items()]
    text = summary_markdown(rows, outcomes, slo, num_prompts)
    (out_dir / "summary.md").write_text(text)
    summary = {"slo": asdict(slo), "rates": rates, "num_prompts": num_prompts, "mix": asdict(mix),
               "server_args": args.server_args,
               "configs": {o.name: {"ok": o.ok, "error": o.error, "command": shlex.join(o.command),
                                    "unloaded_tpot_ms": o.unloaded_tpot_ms,
                                    "results": {f"{r:g}": str(p) for r, p in o.results.items()}}
                           for o in outcomes},
               "rows": [asdict(r) for r in rows], "ratios_over_colocated_chunked": ratios(rows)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if rows:
        plot(rows, slo, out_dir / "disaggregation.png")
    print(text)
    console.print(f"summary: {out_dir / 'summary.md'}, {out_dir / 'summary.json'}")
    return 0 if any(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
