"""Part 3 of benchmarks/kv_store.py, store vs own pool: one long prompt served from the pool, from the host tier
after a flood has evicted it, and from the disk tier of a restarted server."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import tempfile
from typing import Any

import httpx
import numpy as np
from kv_store_common import BLOCK_SIZE, GiB, blocks, console, fmt, ratio, warm_up
from rich.progress import Progress
from server_process import RunFailed, counter_delta, endpoint, log_issues, scrape, serving, timed

from tandem.bench.client import EndpointConfig
from tandem.bench.workloads import TextMaker


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
