"""Parts 1 and 2 of benchmarks/kv_store.py: one `tandem bench serve` workload against a fresh server of each
configuration (pool, tiers), summarised with what served the prompts."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from kv_store_common import Sizing, config_flags, console, pct, settled_scrape, store_report, warm_up
from rich.progress import Progress
from server_process import RunFailed, bench_serve, counter_delta, log_issues, serving, tandem_exe

from tandem.bench.client import RequestRecord
from tandem.bench.report import load_records, result_paths
from tandem.bench.workloads import TextMaker


@dataclass
class Part:
    name: str
    sizing: Sizing
    client_flags: list[str]
    label: str
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_workload(part: Part, config: str, args: argparse.Namespace, maker: TextMaker, progress: Progress) -> None:
    disk_dir = tempfile.mkdtemp(prefix=f"tandem-kv-bench-{part.name}-") if config == "tiers" else None
    name = f"{part.name}-{config}"
    try:
        with serving(name, config_flags(config, part.sizing, disk_dir), args, progress) as server:
            asyncio.run(warm_up(server.url, maker, args.seed))
            before = settled_scrape(server.url)
            filename = f"{name}.json"
            client_log = args.out_dir / f"{name}.client.log"
            client_log.write_text("")
            started = time.monotonic()
            bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--ignore-eos", "--save-result",
                         "--result-dir", str(args.out_dir), "--result-filename", filename, "--disable-tqdm",
                         "--metric-percentiles", "50,90,99", "--seed", str(args.seed), "--label", name,
                         *part.client_flags], client_log, progress, f"{name}: {part.label}")
            wall = time.monotonic() - started
            after = settled_scrape(server.url)
        result = json.loads((args.out_dir / filename).read_text())
        records = load_records(result_paths(result, str(args.out_dir), filename)["records"])
        prompt_tokens = counter_delta(before, after, "tandem:prompt_tokens_total")
        run = summarize(result, records, store_report(before, after, prompt_tokens), args.long_history)
        run |= {"command": shlex.join(server.command), "wall_s": wall, "server_log": str(server.log),
                "log_issues": log_issues(server.log), "records": [(r.turn, r.prompt_len, r.ttft) for r in records
                                                                  if r.success]}
        part.runs[config] = run
        console.print(f"  {name}: TTFT p50 {run['ttft_p50_ms']:.0f} ms, returning p50 "
                      f"{run['returning_ttft_p50_ms'] or 0:.0f} ms, ITL p99 {run['itl_p99_ms']:.0f} ms, pool hits "
                      f"{run['store']['pool_prefix_hit_rate']:.0%}, "
                      + ", ".join(f"{t} hits {s['hit_rate']:.0%}" for t, s in run["store"]["tiers"].items())
                      + f", {run['completed']}/{run['completed'] + run['failed']} ok in {wall:.0f} s")
    except RunFailed as e:
        part.runs[config] = {"error": str(e), "detail": e.detail}
        console.print(f"[red]{name} failed[/]: {e}\n{e.detail}")
    except (RuntimeError, httpx.HTTPError) as e:
        part.runs[config] = {"error": str(e)}
        console.print(f"[red]{name} failed[/]: {e}")
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def summarize(result: dict[str, Any], records: list[RequestRecord], store: dict[str, Any],
              long_history: int) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    returning = [r.ttft for r in ok if r.turn > 0]
    long = [r.ttft for r in ok if r.turn > 0 and r.prompt_len >= long_history]
    by_turn: dict[int, dict[str, Any]] = {}
    for t in sorted({r.turn for r in ok}):
        mine = [r for r in ok if r.turn == t]
        by_turn[t + 1] = {"n": len(mine), "prompt_len_mean": float(np.mean([r.prompt_len for r in mine])),
                          "ttft_p50_ms": pct([r.ttft for r in mine], 50),
                          "ttft_p90_ms": pct([r.ttft for r in mine], 90)}
    return {"completed": result["completed"], "failed": result["failed"], "duration_s": result["duration"],
            "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"], "itl_p50_ms": result["median_itl_ms"],
            "itl_p99_ms": result["p99_itl_ms"], "tpot_p50_ms": result["median_tpot_ms"],
            "output_throughput": result["output_throughput"],
            "returning_ttft_p50_ms": pct(returning, 50), "returning_ttft_p90_ms": pct(returning, 90),
            "long_ttft_p50_ms": pct(long, 50), "long_ttft_p90_ms": pct(long, 90), "long_requests": len(long),
            "by_turn": by_turn, "store": store}
