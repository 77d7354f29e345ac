"""The tiered KV store against the pool alone (recompute), colocated, in one run.

    .venv/bin/python benchmarks/kv_store.py            # the full run (about 17 min on 2 cores)
    .venv/bin/python benchmarks/kv_store.py --quick    # a smoke check (a few minutes)

Every configuration is a fresh `tandem serve` (default model, dtype auto, block size 16) on a free loopback
port with the same flags except the store's, and the load is the project's own client (`tandem bench serve`):
    pool    no store flags: what the pool does not hold is recomputed
    tiers   --kv-offload-memory (sized to hold the working set) --kv-offload-disk <temp dir>
Each part sizes the pool (--num-blocks) so its working set is about --pool-ratio (4) times the pool, yet the
requests in flight fit.
  1. multi-turn: --conversations chats of --turns user turns (--turn-input-len new tokens, --turn-output-len
     reply tokens each; chat backend), --max-concurrency 2, so the sessions interleave and every return finds
     its history evicted from the pool. TTFT p50/p90 of returning turns (2..N) and of those whose history
     is >= --long-history tokens, ITL p99, per-tier hit rates and bytes moved.
  2. Mooncake-trace replay: a synthetic Mooncake-format trace (benchmarks/results/kv_store_trace.jsonl, from --seed):
     --trace-docs shared documents of several 64-token blocks with Zipf-like popularity, each request one
     document plus a unique tail, Poisson arrivals at --trace-rate. The same measures.
  3. store vs own pool: one --probe-len token prompt sent twice (the second is served from the pool), then the
     pool is flooded with other prompts until it has evicted it, then it is sent again (served from the host
     tier) and once more (from the pool again); then a server with only the disk tier, on the same directory,
     serves it from disk. Medians over --probe-reps prompts (each measured request waits --settle seconds, so
     the saver thread is idle), with the prompt's cold (recompute) TTFT for reference; /metrics deltas confirm
     what served each one.
Goals: multi-turn TTFT p50 of returning turns with histories >= 1k tokens, tiers <= 0.2x pool; ITL p99 with tiers
<= 1.05x pool; store-served TTFT <= 1.5x pool-served. Hit rates: store hits * block size / prompt tokens per tier,
and the pool's prefix-cache hit rate, from /metrics deltas (warm-ups excluded).
Results: benchmarks/results/kv_store.json and kv_store.png; per-run client results, records and server logs under
benchmarks/results/kv_store/.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kv_store_common import BLOCK_SIZE, console, finish_run, kv_block_bytes
from kv_store_multiturn import run_multi_turn
from kv_store_probe import run_probe
from kv_store_report import goals_of, plot, tables
from kv_store_trace import run_trace
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from server_process import add_server_args

from tandem.bench.workloads import TextMaker
from tandem.tokenizer import load_tokenizer


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="multi_turn,trace,probe", help="comma-separated: multi_turn, trace, probe")
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere: a smoke check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-ratio", type=float, default=4.0, help="working set over pool (when the requests fit)")
    g = ap.add_argument_group("multi-turn")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=8)
    g.add_argument("--turn-input-len", type=int, default=160, help="new user tokens per turn")
    g.add_argument("--turn-output-len", type=int, default=32, help="reply tokens per turn")
    g.add_argument("--max-concurrency", type=int, default=2)
    g.add_argument("--long-history", type=int, default=1000,
                   help="a returning turn whose prompt (client-counted, without the chat template) has this "
                   "many tokens counts as a long history")
    g = ap.add_argument_group("Mooncake-trace replay")
    g.add_argument("--trace-docs", type=int, default=16, help="shared documents")
    g.add_argument("--trace-doc-blocks", type=int, nargs=2, default=[4, 10], metavar=("MIN", "MAX"),
                   help="a document's length in 64-token trace blocks")
    g.add_argument("--trace-requests", type=int, default=64)
    g.add_argument("--trace-rate", type=float, default=0.5, help="requests per second (Poisson)")
    g.add_argument("--trace-zipf", type=float, default=1.0, help="popularity of document k is 1/k^s")
    g.add_argument("--trace-output-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    g = ap.add_argument_group("store vs own pool")
    g.add_argument("--probe-len", type=int, default=1024, help="prompt tokens")
    g.add_argument("--probe-output-len", type=int, default=4)
    g.add_argument("--probe-reps", type=int, default=5)
    g.add_argument("--settle", type=float, default=1.0,
                   help="seconds before each measured probe request (background saves finish)")
    add_server_args(ap, Path("benchmarks/results/kv_store"))
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/kv_store.json"))
    ap.add_argument("--plot", type=Path, default=Path("benchmarks/results/kv_store.png"))
    ap.add_argument("--trace-path", type=Path, default=Path("benchmarks/results/kv_store_trace.jsonl"))
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.turn_input_len, args.turn_output_len = 3, 4, 96, 16
        args.trace_docs, args.trace_requests, args.trace_rate, args.trace_doc_blocks = 6, 12, 1.0, [2, 5]
        args.probe_len, args.probe_reps = 512, 1
        args.long_history = 300
    args.part_names = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.part_names if p not in ("multi_turn", "trace", "probe")]
    if bad:
        ap.error(f"--parts: unknown {bad}")
    return args


def main() -> int:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    maker = TextMaker(load_tokenizer(None))
    block_bytes = kv_block_bytes(None)
    started = time.monotonic()
    results: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"block_size": BLOCK_SIZE, "block_bytes": block_bytes, "cpus": os.cpu_count(),
           "tokens_per_turn": args.turn_input_len + args.turn_output_len},
    }
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        if "multi_turn" in args.part_names:
            results["multi_turn"] = run_multi_turn(args, maker, block_bytes, progress)
        if "trace" in args.part_names:
            results["trace"] = run_trace(args, maker, block_bytes, progress)
        if "probe" in args.part_names:
            t0 = time.monotonic()
            results["probe"] = run_probe(args, maker, block_bytes, progress) | {"wall_s": time.monotonic() - t0}
    return finish_run(args, results, started, goals_of, plot, tables, log_issues)


def log_issues(results: dict[str, Any]) -> dict[str, list[str]]:
    issues = {f"{part} {name}": run.get("log_issues") for part in ("multi_turn", "trace")
              for name, run in results.get(part, {}).get("runs", {}).items() if run.get("log_issues")}
    for key in ("log_issues_tiers", "log_issues_disk"):
        if results.get("probe", {}).get(key):
            issues[f"probe {key[11:]}"] = results["probe"][key]
    return issues


if __name__ == "__main__":
    raise SystemExit(main())
