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
import asyncio
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
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
    scrape,
    serving,
    tandem_exe,
    timed,
)

from tandem.bench.client import EndpointConfig, RequestRecord
from tandem.bench.report import load_records, result_paths
from tandem.bench.workloads import TextMaker
from tandem.model.loader import load_tokenizer

console = Console(stderr=True)
GiB = 1 << 30
MiB = 1 << 20
BLOCK_SIZE = 16
TRACE_BLOCK = 64  # tokens per trace hash id: four KV blocks
CHAT_OVERHEAD_PER_MESSAGE = 5  # <|im_start|>role\n ... <|im_end|>\n
CHAT_OVERHEAD_FIXED = 32  # the template's default system message
CONFIGS = ("pool", "tiers")
GOALS = {"multi_turn_long_ttft_p50_tiers_over_pool": 0.2, "multi_turn_itl_p99_tiers_over_pool": 1.05,
         "probe_store_ttft_over_pool": 1.5}


# -- sizes ---------------------------------------------------------------------------------------

def kv_block_bytes(model: str | None) -> int:
    """Bytes of one stored KV block, float32 (an upper bound for auto's dtype), from the GGUF's metadata."""
    try:
        from tandem.model.arch import arch_from_gguf_metadata
        from tandem.model.loader import _read_gguf, resolve_model_path

        tensors, meta = _read_gguf(resolve_model_path(model))
        names = {t.name for t in tensors}
        arch = arch_from_gguf_metadata(meta, "output.weight" in names, "blk.0.attn_q.bias" in names)
        return arch.kv_bytes_per_token(4) * BLOCK_SIZE
    except Exception:  # noqa: BLE001 (an HF directory, another format: SmolLM2-135M's size is a fair guess)
        return 2 * 30 * 3 * 64 * 4 * BLOCK_SIZE


def blocks(tokens: float) -> int:
    return int(math.ceil(tokens / BLOCK_SIZE))


@dataclass
class Sizing:
    working_set_blocks: int
    max_request_blocks: int
    in_flight: int
    pool_ratio: float
    block_bytes: int

    @property
    def pool_blocks(self) -> int:
        # The ratio's pool, unless the requests in flight need more (plus a little for decodes and lookahead).
        return max(blocks(self.working_set_blocks * BLOCK_SIZE / self.pool_ratio),
                   self.in_flight * self.max_request_blocks + 8)

    @property
    def store_gib(self) -> float:
        # The host tier is 8-way set-associative: 3x the working set keeps bucket overflows rare.
        return round(max(0.25, 3 * self.working_set_blocks * self.block_bytes / GiB), 2)

    def as_dict(self) -> dict[str, Any]:
        return {"working_set_blocks": self.working_set_blocks, "max_request_blocks": self.max_request_blocks,
                "in_flight": self.in_flight, "pool_blocks": self.pool_blocks,
                "working_set_over_pool": self.working_set_blocks / self.pool_blocks,
                "store_gib": self.store_gib, "block_bytes": self.block_bytes}


def multi_turn_sizing(args: argparse.Namespace, block_bytes: int) -> Sizing:
    t, i, o = args.turns, args.turn_input_len, args.turn_output_len
    final = t * i + (t - 1) * o + 2 * t * CHAT_OVERHEAD_PER_MESSAGE + CHAT_OVERHEAD_FIXED + o
    return Sizing(args.conversations * blocks(final), blocks(final), args.max_concurrency, args.pool_ratio,
                  block_bytes)


# -- the synthetic Mooncake trace ----------------------------------------------------------------

def make_trace(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Documents (runs of shared hash ids) with Zipf popularity, each request one of them plus a unique tail."""
    rng = np.random.default_rng(args.seed)
    doc_lens = rng.integers(args.trace_doc_blocks[0], args.trace_doc_blocks[1] + 1, args.trace_docs)
    docs, next_id = [], 0
    for n in doc_lens:
        docs.append(list(range(next_id, next_id + int(n))))
        next_id += int(n)
    popularity = 1.0 / np.arange(1, args.trace_docs + 1) ** args.trace_zipf
    popularity /= popularity.sum()
    gaps = rng.exponential(1.0 / args.trace_rate, args.trace_requests)
    times = np.cumsum(gaps) - gaps[0]
    rows, seen = [], set()
    reusable = total = ws_tokens = 0
    max_tokens = 0
    tail_id = 1 << 20  # unique tails: ids no document uses
    for k in range(args.trace_requests):
        d = int(rng.choice(args.trace_docs, p=popularity))
        n_tail = int(rng.integers(1, 3))
        ids = docs[d] + list(range(tail_id, tail_id + n_tail))
        tail_id += n_tail
        n_in = len(ids) * TRACE_BLOCK - int(rng.integers(0, TRACE_BLOCK // 2))
        n_out = int(rng.integers(args.trace_output_len[0], args.trace_output_len[1] + 1))
        rows.append({"timestamp": int(round(times[k] * 1000)), "input_length": n_in, "output_length": n_out,
                     "hash_ids": ids})
        doc_tokens = len(docs[d]) * TRACE_BLOCK
        if d in seen:
            reusable += doc_tokens
        else:
            ws_tokens += doc_tokens
            seen.add(d)
        ws_tokens += n_in - doc_tokens + n_out
        total += n_in
        max_tokens = max(max_tokens, n_in + n_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": str(path), "requests": len(rows), "docs": args.trace_docs, "docs_used": len(seen),
            "duration_s": float(times[-1]), "prompt_tokens": total, "reusable_tokens": reusable,
            "reusable_share": reusable / total, "working_set_tokens": ws_tokens,
            "max_request_tokens": max_tokens}


# -- servers and metrics -------------------------------------------------------------------------

def config_flags(config: str, sizing: Sizing, disk_dir: str | None) -> list[str]:
    flags = ["--num-blocks", str(sizing.pool_blocks), "--block-size", str(BLOCK_SIZE)]
    if config == "tiers":
        flags += ["--kv-offload-memory", str(sizing.store_gib)]
    if config in ("tiers", "disk") and disk_dir is not None:
        flags += ["--kv-offload-disk", disk_dir, "--kv-offload-disk-size", str(round(2 * sizing.store_gib, 2))]
    return flags


def settled_scrape(url: str, wait_s: float = 1.5, by: tuple[str, ...] = ("tier",)) -> dict[tuple, float]:
    # The core sends fresh stats with every step and while idle; the saver thread may still be writing.
    time.sleep(wait_s)
    return scrape(url, by)


def store_report(before: dict, after: dict, prompt_tokens: float) -> dict[str, Any]:
    """Per-tier counters over a run, and the pool's prefix hit rate."""

    def d(name: str, tier: str | None = None) -> float:
        return counter_delta(before, after, name, tier)

    tiers = sorted({t for (_, t) in after if t is not None})
    out: dict[str, Any] = {}
    for t in tiers:
        hits = d("tandem:kv_store_hits_total", t)
        out[t] = {"hit_blocks": hits, "hit_rate": hits * BLOCK_SIZE / prompt_tokens if prompt_tokens else 0.0,
                  "misses": d("tandem:kv_store_misses_total", t),
                  "loaded_bytes": d("tandem:kv_store_loaded_bytes_total", t),
                  "saved_bytes": d("tandem:kv_store_saved_bytes_total", t),
                  "evictions": d("tandem:kv_store_evictions_total", t),
                  "verify_failures": d("tandem:kv_store_verify_failures_total", t),
                  "load_seconds": d("tandem:kv_store_load_seconds_total", t),
                  "used_blocks": after.get(("tandem:kv_store_used_blocks", t), 0.0),
                  "capacity_blocks": after.get(("tandem:kv_store_capacity_blocks", t), 0.0)}
        out[t]["load_ms_per_block"] = 1000 * out[t]["load_seconds"] / hits if hits else None
    queries, hits = d("tandem:prefix_cache_queries_total"), d("tandem:prefix_cache_hits_total")
    return {"prompt_tokens": prompt_tokens, "generation_tokens": d("tandem:generation_tokens_total"),
            "preemptions": d("tandem:num_preemptions_total"),
            "pool_prefix_hit_rate": hits / queries if queries else 0.0, "pool_prefix_hit_tokens": hits,
            "tiers": out}


async def warm_up(url: str, maker: TextMaker, seed: int) -> None:
    """A few unmeasured requests (a long and a short prompt), so no measured request pays for first use."""
    rng = np.random.default_rng([seed, 7])
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        cfg = await endpoint(http, url, "/v1/completions")
        for n in (600, 64):
            await timed(http, cfg, maker.text(rng, n), 8)


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


# -- parts 1 and 2: a workload against each configuration ----------------------------------------

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


# -- part 3: one long prompt from the pool, the host tier, the disk tier -------------------------

async def measured(http: httpx.AsyncClient, cfg: EndpointConfig, prompt: str, args: argparse.Namespace) -> dict:
    """One timed request, with what served its prompt (pool prefix hits, store hits and load time per tier)."""
    await asyncio.sleep(args.settle)  # the saver thread is done with the previous request's blocks
    before = scrape(cfg.base_url)
    record = await timed(http, cfg, prompt, args.probe_output_len)
    await asyncio.sleep(0.5)  # the stats that come with the next heartbeat
    after = scrape(cfg.base_url)
    tiers = sorted({t for (_, t) in after if t is not None})
    return {"ttft_ms": record.ttft * 1000,
            "pool_hit_tokens": counter_delta(before, after, "tandem:prefix_cache_hits_total"),
            "store_hit_blocks": {t: counter_delta(before, after, "tandem:kv_store_hits_total", t) for t in tiers},
            "store_load_ms": {t: 1000 * counter_delta(before, after, "tandem:kv_store_load_seconds_total", t)
                              for t in tiers}}


async def probe_tiers(url: str, maker: TextMaker, args: argparse.Namespace, pool_blocks: int,
                      prompts: list[str]) -> list[dict[str, Any]]:
    """Per prompt: cold (computed), pool (sent again), host (after a flood made the pool evict it), pool again
    (the load put it back in the pool): two pool samples for each host sample, alternating with it."""
    rng = np.random.default_rng([args.seed, 3])
    flood_total = (pool_blocks + 2) * BLOCK_SIZE  # every block the pool had is handed out again
    flood_len = max(pool_blocks * BLOCK_SIZE // 2 - 2 * BLOCK_SIZE, BLOCK_SIZE)
    reps = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        cfg = await endpoint(http, url, "/v1/completions")
        for prompt in prompts:
            rep = {"cold": await measured(http, cfg, prompt, args), "pool": await measured(http, cfg, prompt, args)}
            sent = 0
            while sent < flood_total:
                n = min(flood_len, flood_total - sent + BLOCK_SIZE)
                await timed(http, cfg, maker.text(rng, n), 1)
                sent += n
            rep["host"] = await measured(http, cfg, prompt, args)
            rep["pool_again"] = await measured(http, cfg, prompt, args)
            reps.append(rep)
    return reps


async def probe_disk(url: str, args: argparse.Namespace, prompts: list[str]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        cfg = await endpoint(http, url, "/v1/completions")
        return [await measured(http, cfg, prompt, args) for prompt in prompts]


def run_probe(args: argparse.Namespace, maker: TextMaker, block_bytes: int, progress: Progress) -> dict[str, Any]:
    per = blocks(args.probe_len + args.probe_output_len)
    pool_blocks = per + 16  # the prompt, or a flood prompt of half the pool, with room to spare
    # The store holds every prompt, flood and warm-up; 3x for the host tier's set associativity.
    store_gib = round(max(0.25, 3 * (args.probe_reps + 2) * (per + pool_blocks) * block_bytes / GiB), 2)
    rng = np.random.default_rng([args.seed, 2])
    prompts = [maker.text(rng, args.probe_len) for _ in range(args.probe_reps)]
    disk_dir = tempfile.mkdtemp(prefix="tandem-kv-bench-probe-")
    out: dict[str, Any] = {"pool_blocks": pool_blocks, "prompt_tokens": args.probe_len, "reps": args.probe_reps,
                           "store_gib": store_gib}
    pool_flags = ["--num-blocks", str(pool_blocks), "--block-size", str(BLOCK_SIZE)]
    disk_flags = ["--kv-offload-disk", disk_dir, "--kv-offload-disk-size", str(2 * store_gib)]
    try:
        with serving("probe-tiers", [*pool_flags, "--kv-offload-memory", str(store_gib), *disk_flags], args,
                     progress) as server:
            task = progress.add_task(f"probe: {args.probe_reps} x (cold, pool, flood, host tier, pool)", total=None)
            asyncio.run(warm_up(server.url, maker, args.seed))
            out["reps_tiers"] = asyncio.run(probe_tiers(server.url, maker, args, pool_blocks, prompts))
            progress.remove_task(task)
            out["command_tiers"] = shlex.join(server.command)
        out["log_issues_tiers"] = log_issues(server.log)
        # A new server on the same directory: an empty pool, no host tier, the blocks on disk.
        with serving("probe-disk", [*pool_flags, *disk_flags], args, progress) as server:
            task = progress.add_task(f"probe: {args.probe_reps} x disk tier (a restarted server)", total=None)
            asyncio.run(warm_up(server.url, maker, args.seed + 1))
            out["reps_disk"] = asyncio.run(probe_disk(server.url, args, prompts))
            progress.remove_task(task)
            out["command_disk"] = shlex.join(server.command)
        out["log_issues_disk"] = log_issues(server.log)
    except (RunFailed, RuntimeError, httpx.HTTPError) as e:
        out["error"] = str(e)
        console.print(f"[red]probe failed[/]: {e}")
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    samples = {kind: [r[kind] for r in out.get("reps_tiers", [])] for kind in ("cold", "pool", "host")}
    samples["pool"] += [r["pool_again"] for r in out.get("reps_tiers", [])]
    samples["disk"] = out.get("reps_disk", [])
    for kind, reps in samples.items():
        out[f"{kind}_ttft_median_ms"] = float(np.median([r["ttft_ms"] for r in reps])) if reps else None
        out[f"{kind}_pool_hit_tokens"] = [r["pool_hit_tokens"] for r in reps]
        out[f"{kind}_store_hit_blocks"] = [r["store_hit_blocks"] for r in reps]
        load = [sum(r["store_load_ms"].values()) for r in reps]
        out[f"{kind}_store_load_ms_median"] = float(np.median(load)) if load else None
    for kind in ("cold", "host", "disk"):
        out[f"{kind}_over_pool"] = ratio(out[f"{kind}_ttft_median_ms"], out["pool_ttft_median_ms"])
    console.print("  probe medians: " + ", ".join(f"{k} {fmt(out[f'{k}_ttft_median_ms'])} ms"
                                                  for k in ("cold", "pool", "host", "disk")))
    for kind in ("pool", "host", "disk"):
        load = fmt(out[f"{kind}_store_load_ms_median"], ".1f")
        console.print(f"  {kind}-served: pool hits {out[f'{kind}_pool_hit_tokens']} tokens, store hits "
                      f"{out[f'{kind}_store_hit_blocks']} blocks, store load {load} ms")
    return out


# -- report --------------------------------------------------------------------------------------

def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def goals_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    mt = results.get("multi_turn", {}).get("runs", {})
    pool, tiers = mt.get("pool", {}), mt.get("tiers", {})
    probe = results.get("probe", {})
    values = {"multi_turn_long_ttft_p50_tiers_over_pool": ratio(tiers.get("long_ttft_p50_ms"),
                                                                pool.get("long_ttft_p50_ms")),
              "multi_turn_itl_p99_tiers_over_pool": ratio(tiers.get("itl_p99_ms"), pool.get("itl_p99_ms")),
              "probe_store_ttft_over_pool": probe.get("host_over_pool")}
    return {k: {"value": v, "goal": f"<= {GOALS[k]:g}", "met": None if v is None else v <= GOALS[k]}
            for k, v in values.items()}


ROWS = [("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p90 (ms)", "ttft_p90_ms"),
        ("returning TTFT p50 (ms)", "returning_ttft_p50_ms"), ("returning TTFT p90 (ms)", "returning_ttft_p90_ms"),
        ("history>=1k TTFT p50 (ms)", "long_ttft_p50_ms"), ("history>=1k TTFT p90 (ms)", "long_ttft_p90_ms"),
        ("ITL p50 (ms)", "itl_p50_ms"), ("ITL p99 (ms)", "itl_p99_ms"), ("duration (s)", "duration_s")]


def tables(results: dict[str, Any]) -> list[Table]:
    out = []
    for part in ("multi_turn", "trace"):
        runs = results.get(part, {}).get("runs", {})
        if not runs:
            continue
        t = Table(title=f"{part}: pool alone vs tiers")
        for col in ("measure", "pool", "tiers", "tiers/pool"):
            t.add_column(col, justify="left" if col == "measure" else "right")
        pool, tiers = runs.get("pool", {}), runs.get("tiers", {})
        for label, key in ROWS:
            if part == "trace" and key.startswith(("returning", "long")):
                continue
            a, b = pool.get(key), tiers.get(key)
            t.add_row(label, fmt(a), fmt(b), fmt(ratio(b, a), ".2f"))
        for label, key, spec in (("prompt tokens (server)", "prompt_tokens", ".0f"),
                                 ("preemptions", "preemptions", ".0f"),
                                 ("pool prefix hit rate", "pool_prefix_hit_rate", ".1%")):
            t.add_row(label, *(fmt(r.get("store", {}).get(key), spec) for r in (pool, tiers)), "")
        names = sorted({n for r in (pool, tiers) for n in r.get("store", {}).get("tiers", {})})
        for name in names:
            s = [r.get("store", {}).get("tiers", {}).get(name) for r in (pool, tiers)]
            t.add_row(f"{name} tier hit rate", *(fmt(x["hit_rate"], ".1%") if x else "-" for x in s), "")
            t.add_row(f"{name} loaded / saved (MiB)",
                      *(f"{x['loaded_bytes'] / MiB:.0f} / {x['saved_bytes'] / MiB:.0f}" if x else "-" for x in s), "")
            t.add_row(f"{name} load ms/block, evictions, verify fails",
                      *(f"{fmt(x['load_ms_per_block'], '.2f')}, {x['evictions']:.0f}, {x['verify_failures']:.0f}"
                        if x else "-" for x in s), "")
        reusable = results[part].get("reusable_share")
        if reusable is not None:
            t.add_row("reusable share of prompt tokens", f"{reusable:.1%}", "", "")
        out.append(t)
    probe = results.get("probe")
    if probe and probe.get("pool_ttft_median_ms") is not None:
        t = Table(title=f"one {probe['prompt_tokens']}-token prompt: TTFT median of {probe['reps']} "
                  f"({2 * probe['reps']} from the pool)")
        for col in ("served from", "TTFT (ms)", "x pool", "store load (ms)"):
            t.add_column(col, justify="left" if col == "served from" else "right")
        for kind, label in (("cold", "recompute (cold)"), ("pool", "own pool"), ("host", "host tier"),
                            ("disk", "disk tier (restarted server)")):
            t.add_row(label, fmt(probe[f"{kind}_ttft_median_ms"]),
                      "1.00" if kind == "pool" else fmt(probe.get(f"{kind}_over_pool"), ".2f"),
                      fmt(probe.get(f"{kind}_store_load_ms_median"), ".1f") if kind in ("host", "disk") else "")
        out.append(t)
    g = Table(title="goals")
    for col in ("goal", "value", "target", "met"):
        g.add_column(col)
    for name, row in results["goals"].items():
        met = {True: "[green]pass[/]", False: "[red]miss[/]", None: "-"}[row["met"]]
        g.add_row(name, fmt(row["value"], ".3f"), row["goal"], met)
    out.append(g)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"pool": "tab:red", "tiers": "tab:blue"}
    ax = axes[0]
    for config, run in results.get("multi_turn", {}).get("runs", {}).items():
        if "by_turn" not in run:
            continue
        turns = sorted(run["by_turn"], key=int)
        ax.plot([int(t) for t in turns], [run["by_turn"][t]["ttft_p50_ms"] for t in turns], marker="o",
                color=colors.get(config), label=f"{config} p50")
        ax.plot([int(t) for t in turns], [run["by_turn"][t]["ttft_p90_ms"] for t in turns], ls=":",
                color=colors.get(config), label=f"{config} p90")
    ax.set_xlabel(f"turn (the history grows ~{results['settings']['tokens_per_turn']} tokens a turn)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("multi-turn: TTFT by turn")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[1]
    for config, run in results.get("trace", {}).get("runs", {}).items():
        ttfts = sorted(1000 * r[2] for r in run.get("records", []))
        if ttfts:
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), color=colors.get(config), label=config)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the minor labels overlap
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Mooncake-trace replay: TTFT CDF")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[2]
    probe = results.get("probe", {})
    kinds = [("cold", "recompute"), ("pool", "own pool"), ("host", "host tier"), ("disk", "disk tier")]
    values = [probe.get(f"{k}_ttft_median_ms") or 0.0 for k, _ in kinds]
    ax.bar([label for _, label in kinds], values, color=["tab:gray", "tab:green", "tab:blue", "tab:purple"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("TTFT (ms), median")
    ax.set_title(f"one {probe.get('prompt_tokens', '?')}-token prompt, served from")
    fig.suptitle("tiered KV store vs the pool alone (colocated tandem serve)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
            sizing = multi_turn_sizing(args, block_bytes)
            part = Part("multi_turn", sizing,
                        ["--backend", "openai-chat", "--dataset-name", "multi_turn", "--num-prompts",
                         str(args.conversations), "--multi-turn-turns", str(args.turns), "--multi-turn-input-len",
                         str(args.turn_input_len), "--multi-turn-output-len", str(args.turn_output_len),
                         "--max-concurrency", str(args.max_concurrency)],
                        f"{args.conversations} conversations x {args.turns} turns, concurrency {args.max_concurrency}")
            t0 = time.monotonic()
            for config in CONFIGS:
                run_workload(part, config, args, maker, progress)
            t, i, o = args.turns, args.turn_input_len, args.turn_output_len
            history = sum((k * i + (k - 1) * o) - i for k in range(1, t + 1))
            results["multi_turn"] = {"sizing": sizing.as_dict(), "runs": part.runs, "wall_s": time.monotonic() - t0,
                                     "reusable_share": history / sum(k * i + (k - 1) * o for k in range(1, t + 1))}
        if "trace" in args.part_names:
            trace = make_trace(args, args.trace_path)
            max_blocks = blocks(trace["max_request_tokens"])
            sizing = Sizing(blocks(trace["working_set_tokens"]), max_blocks, 4, args.pool_ratio, block_bytes)
            part = Part("trace", sizing,
                        ["--backend", "openai", "--dataset-name", "mooncake_trace", "--dataset-path",
                         str(args.trace_path), "--trace-block-size", str(TRACE_BLOCK), "--num-prompts",
                         str(trace["requests"])],
                        f"{trace['requests']} requests over {trace['duration_s']:.0f} s")
            t0 = time.monotonic()
            for config in CONFIGS:
                run_workload(part, config, args, maker, progress)
            results["trace"] = trace | {"sizing": sizing.as_dict(), "runs": part.runs,
                                        "wall_s": time.monotonic() - t0}
        if "probe" in args.part_names:
            t0 = time.monotonic()
            results["probe"] = run_probe(args, maker, block_bytes, progress) | {"wall_s": time.monotonic() - t0}
    results["wall_s"] = time.monotonic() - started
    results["goals"] = goals_of(results)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.plot)
    out = Console()
    for table in tables(results):
        out.print(table)
    issues = {f"{part} {name}": run.get("log_issues") for part in ("multi_turn", "trace")
              for name, run in results.get(part, {}).get("runs", {}).items() if run.get("log_issues")}
    for key in ("log_issues_tiers", "log_issues_disk"):
        if results.get("probe", {}).get(key):
            issues[f"probe {key[11:]}"] = results["probe"][key]
    for name, lines in issues.items():
        out.print(f"[yellow]server log ({name}): {len(lines)} warning/error lines[/], first: {lines[0]}")
    out.print(f"total {results['wall_s'] / 60:.1f} min; results: {args.results}, plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
