"""KV-aware routing against least-loaded, two colocated one-core workers behind the router, in one run (issue #16).

    .venv/bin/python benchmarks/cluster.py            # part 1 in full (about 14 min on 2 cores)
    .venv/bin/python benchmarks/cluster.py --quick    # a smoke check (a few minutes)

Part 1 (routing). Every run is a fresh `tandem serve --workers 2 --routing-policy P --num-blocks N` (default model,
dtype auto, one core per worker; P = kv or least-loaded, all else identical) loaded by `tandem bench serve`
(ignore_eos), the policies' order alternating by workload so a drifting machine favours neither. Unmeasured: two
concurrent warm-up requests (one per worker), then (--prime) each system prompt of workloads 1 and 3 once, all at
once, so the run sees a warm cluster rather than its first minute. --num-blocks sizes each worker's pool to hold a
little more than half of workload 1's prefixes: what routing by prefix can gain is the two pools acting as one cache.
  1. shared prefix: --prefixes system prompts of --prefix-len tokens (dataset prefix_repetition), a unique
     --suffix-len suffix and --output-len tokens out each, --shared-requests at Poisson --shared-rate/s. TTFT, ITL.
  2. multi-turn: --conversations chats of --turns user turns (--turn-input-len new tokens, --turn-output-len reply
     tokens a turn; chat backend), chats starting at Poisson --turn-rate/s, each turn sent --turn-think-time s
     (mean, exponential) after the last reply, as users do: meanwhile other chats land. TTFT of turns >= 2.
  3. single shared prefix: one --prefix-len prefix, --single-requests at --single-rate/s. Per-worker load: the
     router's `tandem:router_routed_prompt_blocks_total{worker_id}` over the run (max / mean), and
     `tandem:worker_num_requests_running` sampled every --sample-interval s; TTFT against least-loaded.
Per run, from /metrics deltas: the router's per-worker overlap hit rate (router_routed_overlap_blocks_total / prompt
blocks) and the workers' prefix-cache hit rate (prefix_cache_hits_total / queries).
Goals: TTFT p50 (workload 2: of turns >= 2) with kv at most 0.33x least-loaded; no worker over 1.5x the mean load
with a single shared prefix under kv.
Part 2 (planner on vs the best static split on a shifting trace) is not written yet; see "part 2" below.
Results: benchmarks/results/cluster.json, docs/cluster_routing.png; per-run results and logs under
benchmarks/results/cluster/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from kv_store_common import finish_run, fmt, pct, ratio, settled_scrape
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from server_process import (
    RunFailed,
    add_server_args,
    bench_serve,
    counter_delta,
    endpoint,
    log_issues,
    log_tail,
    scrape,
    serving,
    tandem_exe,
    timed,
)

from tandem.bench.report import load_records, result_paths
from tandem.bench.workloads import TextMaker, WorkloadConfig, generate
from tandem.tokenizer import load_tokenizer

console = Console(stderr=True)
POLICIES = ("kv", "least-loaded")
WORKLOADS = ("shared_prefix", "multi_turn", "single_prefix")
BENIGN = re.compile(r"joined|listening on")  # the router logs its workers' arrival at WARNING
# The router's default. (Before workers said Alive from a thread during long steps, a 4-5 s prefill step on one
# core got them declared dead mid-step, and this benchmark ran with 30 s.)
HEARTBEAT_TIMEOUT_S = 5.0
WORKER_LABELS = ("worker", "worker_id")  # the workers' gauges say worker=, the router's routing counters worker_id=
GOALS = {"shared_prefix_ttft_p50_kv_over_least_loaded": 0.33, "multi_turn_later_ttft_p50_kv_over_least_loaded": 0.33,
         "single_prefix_max_over_mean_load_kv": 1.5}


# -- one run: a fresh deployment, a warm-up, one `tandem bench serve` --------------------------------------

@dataclass
class Workload:
    name: str
    label: str
    client_flags: list[str]
    headline: str  # the run's TTFT key the goal compares: ttft or later_ttft (turns >= 2)
    prime: int = 0  # prefix_repetition: its first `prime` prefixes are sent once, unmeasured, before the run


def sample(url: str, interval: float, stop: threading.Event, samples: list[dict]) -> None:
    """Polls the router's per-worker gauges while the load runs (the workers report them with each step)."""
    while not stop.wait(interval):
        with contextlib.suppress(httpx.HTTPError):  # a slow scrape while both cores are busy: no sample
            samples.append(scrape(url, WORKER_LABELS))


async def warm_up(url: str, maker: TextMaker, seed: int) -> None:
    """Two requests at a time (the router sends the second to the other worker), a long pair then a short one."""
    rng = np.random.default_rng([seed, 7])
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        cfg = await endpoint(http, url, "/v1/completions")
        for n in (600, 64):
            await asyncio.gather(*(timed(http, cfg, maker.text(rng, n), 8) for _ in range(2)))


async def prime(url: str, maker: TextMaker, args: argparse.Namespace, prefixes: int) -> None:
    """The workload's system prompts once each, at once (the same seed draws the same prefixes; other suffixes)."""
    cfg = WorkloadConfig("prefix_repetition", prefixes, args.seed, prefix_repetition_num_prefixes=prefixes,
                         prefix_repetition_prefix_len=args.prefix_len, prefix_repetition_suffix_len=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        cfg_ = await endpoint(http, url, "/v1/completions")
        await asyncio.gather(*(timed(http, cfg_, s.turns[0].prompt, 1) for s in generate(cfg, maker)))


def max_over_mean(values: dict[str, float]) -> float | None:
    mean = float(np.mean(list(values.values()))) if values else 0.0
    return max(values.values()) / mean if mean > 0 else None


def run_policy(work: Workload, policy: str, args: argparse.Namespace, maker: TextMaker, progress: Progress) -> dict:
    name = f"{work.name}-{policy}"
    flags = ["--workers", "2", "--routing-policy", policy, "--num-blocks", str(args.num_blocks),
             "--worker-heartbeat-timeout", str(args.heartbeat_timeout)]
    try:
        with serving(name, flags, args, progress) as server:
            asyncio.run(warm_up(server.url, maker, args.seed))
            if work.prime and args.prime:
                asyncio.run(prime(server.url, maker, args, work.prime))
            before = settled_scrape(server.url, by=WORKER_LABELS)
            (client_log := args.out_dir / f"{name}.client.log").write_text("")
            stop, samples = threading.Event(), []
            sampler = threading.Thread(target=sample, args=(server.url, args.sample_interval, stop, samples))
            sampler.start()
            started = time.monotonic()
            try:
                bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--ignore-eos",
                             "--save-result", "--result-dir", str(args.out_dir), "--result-filename", f"{name}.json",
                             "--disable-tqdm", "--metric-percentiles", "50,90,99", "--seed", str(args.seed),
                             "--label", name, *work.client_flags], client_log, progress, f"{name}: {work.label}")
            finally:
                stop.set()
                sampler.join()
            wall = time.monotonic() - started
            after = settled_scrape(server.url, by=WORKER_LABELS)
        result = json.loads((args.out_dir / f"{name}.json").read_text())
        records = [r for r in load_records(result_paths(result, str(args.out_dir), f"{name}.json")["records"])
                   if r.success]
    except (RunFailed, RuntimeError, httpx.HTTPError) as e:  # the run is reported as failed; the others go on
        console.print(f"[red]{name} failed[/]: {e}\n{getattr(e, 'detail', '')}")
        return {"error": str(e), "detail": getattr(e, "detail", ""),
                "server_log_tail": log_tail(args.out_dir / f"{name}.server.log", 20)}
    workers = sorted({w for (n, w) in after if n == "tandem:worker_up" and w is not None})
    d = functools.partial(counter_delta, before, after)  # d(metric, worker=None): the counter's growth
    blocks = {w: d("tandem:router_routed_prompt_blocks_total", w) for w in workers}
    overlap = {w: d("tandem:router_routed_overlap_blocks_total", w) for w in workers}
    running = {w: float(np.mean([x.get(("tandem:worker_num_requests_running", w), 0.0) for x in samples] or [0]))
               for w in workers}
    queries, hits = d("tandem:prefix_cache_queries_total"), d("tandem:prefix_cache_hits_total")
    later = [r.ttft for r in records if r.turn > 0]
    run = {"completed": result["completed"], "failed": result["failed"], "duration_s": result["duration"],
           "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
           "ttft_p99_ms": result["p99_ttft_ms"], "itl_p50_ms": result["median_itl_ms"],
           "itl_p99_ms": result["p99_itl_ms"], "tpot_p50_ms": result["median_tpot_ms"],
           "output_throughput": result["output_throughput"],
           "later_ttft_p50_ms": pct(later, 50), "later_ttft_p90_ms": pct(later, 90), "later_requests": len(later),
           "workers": {w: {"prompt_blocks": blocks[w], "overlap_blocks": overlap[w],
                           "router_hit_rate": overlap[w] / blocks[w] if blocks[w] else None,
                           "running_mean": running[w]} for w in workers},
           "load_max_over_mean": max_over_mean(blocks), "running_max_over_mean": max_over_mean(running),
           "router_hit_rate": sum(overlap.values()) / sum(blocks.values()) if sum(blocks.values()) else None,
           "prefix_cache_hit_rate": hits / queries if queries else None, "loadavg": os.getloadavg(),
           "prompt_tokens": d("tandem:prompt_tokens_total"), "preemptions": d("tandem:num_preemptions_total"),
           "samples": len(samples),
           "command": shlex.join(server.command), "wall_s": wall, "server_log": str(server.log),
           "log_issues": [x for x in log_issues(server.log) if not BENIGN.search(x)],
           "ttfts": [(r.turn, round(r.ttft, 4)) for r in records]}
    console.print(f"  {name}: TTFT p50 / p90 {fmt(run['ttft_p50_ms'])} / {fmt(run['ttft_p90_ms'])} ms (turns >= 2: "
                  f"{fmt(run['later_ttft_p50_ms'])}), ITL p99 {fmt(run['itl_p99_ms'])} ms, routed blocks "
                  f"{' / '.join(f'{blocks[w]:.0f}' for w in workers)}, router hits {fmt(run['router_hit_rate'], '.0%')}"
                  f", pool hits {fmt(run['prefix_cache_hit_rate'], '.0%')}, {result['failed']} failed, {wall:.0f} s")
    return run


# -- part 1: kv vs least-loaded on three workloads ---------------------------------------------------------

def workloads(args: argparse.Namespace) -> list[Workload]:
    prefix = ["--backend", "openai", "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
              str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
              "--prefix-repetition-output-len", str(args.output_len)]
    return [Workload("shared_prefix", f"{args.prefixes} prefixes, {args.shared_requests} requests at "
                     f"{args.shared_rate:g}/s", [*prefix, "--prefix-repetition-num-prefixes", str(args.prefixes),
                                                 "--num-prompts", str(args.shared_requests), "--request-rate",
                                                 str(args.shared_rate)], "ttft", args.prefixes),
            Workload("multi_turn", f"{args.conversations} chats x {args.turns} turns, chats at {args.turn_rate:g}/s",
                     ["--backend", "openai-chat", "--dataset-name", "multi_turn", "--num-prompts",
                      str(args.conversations), "--multi-turn-turns", str(args.turns), "--multi-turn-input-len",
                      str(args.turn_input_len), "--multi-turn-output-len", str(args.turn_output_len),
                      "--request-rate", str(args.turn_rate), "--think-time", str(args.turn_think_time)], "later_ttft"),
            Workload("single_prefix", f"1 prefix, {args.single_requests} requests at {args.single_rate:g}/s",
                     [*prefix, "--prefix-repetition-num-prefixes", "1", "--num-prompts", str(args.single_requests),
                      "--request-rate", str(args.single_rate)], "ttft", 1)]


def part1_routing(args: argparse.Namespace, maker: TextMaker, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, work in enumerate(w for w in workloads(args) if w.name in args.workloads):
        t0 = time.monotonic()
        order = POLICIES if i % 2 == 0 else POLICIES[::-1]
        runs = {policy: run_policy(work, policy, args, maker, progress) for policy in order}
        kv, ll = runs["kv"], runs["least-loaded"]
        h = work.headline  # the ratios are of this TTFT
        out[work.name] = {"label": work.label, "order": list(order), "headline": h, "runs": runs,
                          "wall_s": time.monotonic() - t0} | {
            f"{k}_{q}_kv_over_least_loaded": ratio(kv.get(f"{k}_{q}_ms"), ll.get(f"{k}_{q}_ms"))
            for k, q in ((h, "p50"), (h, "p90"), ("itl", "p99"))}
    return out


# -- part 2: planner on vs the best static split of the same cores on a shifting trace (not written yet) --
# It goes here as `part2_planner(args, maker, progress) -> dict`, registered in PARTS below: a trace whose mix
# shifts (a prefill-heavy phase of long prompts, then a decode-heavy phase of long outputs) against `--planner on`
# and each static prefill/decode split; goodput (>= 1.2x the best static split) and the planner's actions over
# time against TTFT and ITL. run_policy's deployment-per-run, warm-up and /metrics deltas are meant to serve it.

PARTS: dict[str, Callable[[argparse.Namespace, TextMaker, Progress], dict[str, Any]]] = {"routing": part1_routing}


# -- report ------------------------------------------------------------------------------------------------

def goals_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    routing = results.get("routing", {})
    r = {name: routing.get(name, {}) for name in WORKLOADS}
    values = dict(zip(GOALS, (r["shared_prefix"].get("ttft_p50_kv_over_least_loaded"),
                              r["multi_turn"].get("later_ttft_p50_kv_over_least_loaded"),
                              r["single_prefix"].get("runs", {}).get("kv", {}).get("load_max_over_mean")), strict=True))
    return {k: {"value": v, "goal": f"<= {GOALS[k]:g}", "met": None if v is None else v <= GOALS[k]}
            for k, v in values.items()}


ROWS = [("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p90 (ms)", "ttft_p90_ms"), ("TTFT p50, turns >= 2 (ms)",
        "later_ttft_p50_ms"), ("TTFT p90, turns >= 2 (ms)", "later_ttft_p90_ms"), ("ITL p50 (ms)", "itl_p50_ms"),
        ("ITL p99 (ms)", "itl_p99_ms"), ("TPOT p50 (ms)", "tpot_p50_ms"), ("duration (s)", "duration_s"),
        ("router overlap hit rate", "router_hit_rate"), ("workers' prefix-cache hit rate", "prefix_cache_hit_rate"),
        ("preemptions", "preemptions"), ("load max / mean (routed blocks)", "load_max_over_mean"),
        ("load max / mean (running, sampled)", "running_max_over_mean")]


def tables(results: dict[str, Any]) -> list[Table]:
    out = []
    for name, part in results.get("routing", {}).items():
        kv, ll = part["runs"].get("kv", {}), part["runs"].get("least-loaded", {})
        t = Table(title=f"{name}: {part['label']} (order {' then '.join(part['order'])})")
        for col in ("measure", "kv", "least-loaded", "kv / least-loaded"):
            t.add_column(col, justify="left" if col == "measure" else "right")
        for label, key in ROWS:
            spec = ".1%" if key.endswith("rate") else ".2f" if key.endswith("over_mean") else ".0f"
            if key.startswith("later") and name != "multi_turn":
                continue
            a, b = kv.get(key), ll.get(key)
            t.add_row(label, fmt(a, spec), fmt(b, spec), fmt(ratio(a, b), ".2f") if key.endswith("_ms") else "")
        for w in sorted(set(kv.get("workers", {})) | set(ll.get("workers", {}))):
            s = [r.get("workers", {}).get(w) for r in (kv, ll)]
            t.add_row(f"{w}: routed blocks, router hits, mean running",
                      *(f"{x['prompt_blocks']:.0f}, {fmt(x['router_hit_rate'], '.0%')}, {x['running_mean']:.2f}"
                        if x else "-" for x in s), "")
        if any(r.get("error") for r in (kv, ll)):
            t.add_row("[red]error[/]", *(r.get("error", "")[:60] for r in (kv, ll)), "")
        out.append(t)
    g = Table("goal", "value", "target", "met", title="goals")
    for name, row in results["goals"].items():
        g.add_row(name, fmt(row["value"], ".3f"), row["goal"], {True: "[green]pass[/]", False: "[red]miss[/]",
                                                                 None: "-"}[row["met"]])
    out.append(g)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colors = {"kv": "tab:blue", "least-loaded": "tab:red"}
    routing = results.get("routing", {})
    ax = axes[0]
    names = list(routing)
    for j, policy in enumerate(POLICIES):
        for k, q in enumerate(("p50", "p90")):
            x = np.arange(len(names)) + (2 * j + k - 1.5) * 0.2
            vals = [routing[n]["runs"].get(policy, {}).get(f"{routing[n]['headline']}_{q}_ms") or 0.0 for n in names]
            ax.bar(x, vals, 0.2, color=colors[policy], alpha=1.0 if q == "p50" else 0.45, label=f"{policy} {q}")
            for xi, v in zip(x, vals, strict=True):
                ax.text(xi, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(names)), [n.replace("multi_turn", "multi_turn (turns >= 2)") for n in names])
    ax.set(ylabel="TTFT (ms)", title="TTFT by workload and routing policy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    runs = routing.get("single_prefix", {}).get("runs", {})
    workers = sorted({w for r in runs.values() for w in r.get("workers", {})})
    for j, policy in enumerate(POLICIES):
        per = runs.get(policy, {}).get("workers", {})
        total = sum(per[w]["prompt_blocks"] for w in per) or 1.0
        x = np.arange(len(workers)) + (j - 0.5) * 0.35
        vals = [per.get(w, {}).get("prompt_blocks", 0.0) / total for w in workers]
        ax.bar(x, vals, 0.35, color=colors[policy], label=policy)
        for xi, w, v in zip(x, workers, vals, strict=True):
            ax.text(xi, v, f"{v:.0%}\n{per.get(w, {}).get('running_mean', 0.0):.1f} run", ha="center", va="bottom",
                    fontsize=7)
    if workers:
        ax.axhline(1 / len(workers), color="gray", ls=":", lw=1)
    ax.set_xticks(np.arange(len(workers)), workers)
    ax.set(ylim=(0, 1), ylabel="share of routed prompt blocks")
    ax.set_title("single shared prefix: per-worker load\n(label: share, mean running requests)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle("KV-aware vs least-loaded routing, 2 colocated one-core workers (tandem serve --workers 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="part 1's workloads")
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere: a smoke check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=352, help="KV pool of each worker, in 16-token blocks")
    ap.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                    help="send workloads 1 and 3's prefixes once before the measured run")
    # The workloads' sizes (the module docstring says what each is); rates in requests per second, Poisson.
    for group, sizes in (("shared prefix (1), single prefix (3)",
                          (("--prefixes", 8), ("--prefix-len", 1024), ("--suffix-len", 64), ("--output-len", 16),
                           ("--shared-requests", 28), ("--shared-rate", 0.3), ("--single-requests", 48),
                           ("--single-rate", 0.6))),
                         ("multi-turn (2)", (("--conversations", 10), ("--turns", 6), ("--turn-input-len", 128),
                                             ("--turn-output-len", 32), ("--turn-rate", 0.15),
                                             ("--turn-think-time", 5.0)))):
        g = ap.add_argument_group(group)
        for flag, default in sizes:
            g.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--sample-interval", type=float, default=0.5, help="seconds between per-worker gauge samples")
    ap.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S, help="--worker-heartbeat-timeout")
    add_server_args(ap, Path("benchmarks/results/cluster"))
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/cluster.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/cluster_routing.png"))
    args = ap.parse_args()
    if args.quick:
        args.prefixes, args.prefix_len, args.shared_requests, args.shared_rate = 4, 256, 12, 1.0
        args.single_requests, args.single_rate, args.num_blocks = 12, 1.0, 96
        args.conversations, args.turns, args.turn_input_len, args.turn_output_len = 3, 3, 64, 16
    return args


def git(*argv: str) -> str:
    r = subprocess.run(["git", *argv], cwd=Path(__file__).parent, capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def main() -> int:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    maker = TextMaker(load_tokenizer(None))
    started = time.monotonic()
    results: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]), "commit": git("rev-parse", "HEAD") or None,
        "tandem_changes": git("status", "--porcelain", "--", "tandem").splitlines(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"cpus": os.cpu_count()}}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for part in args.parts:
            results[part] = PARTS[part](args, maker, progress)
    return finish_run(args, results, started, goals_of, plot, tables, routing_log_issues)


def routing_log_issues(results: dict[str, Any]) -> dict[str, list[str]]:
    return {f"{n} {p}": r["log_issues"] for n, part in results.get("routing", {}).items()
            for p, r in part["runs"].items() if r.get("log_issues")}


if __name__ == "__main__":
    raise SystemExit(main())
