"""What the three parts of benchmarks/kv_store.py share: the block size and the pool sizing, the server flags of
each configuration, /metrics read into per-tier store counters, a warm-up, and the number helpers (which
benchmarks/cluster.py and planner.py use too)."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from server_process import counter_delta, endpoint, scrape, timed

from tandem.bench.workloads import TextMaker

console = Console(stderr=True)
GiB = 1 << 30
MiB = 1 << 20
BLOCK_SIZE = 16
CONFIGS = ("pool", "tiers")


# -- sizes ---------------------------------------------------------------------------------------

def kv_block_bytes(model: str | None) -> int:
    """Bytes of one stored KV block, float32 (an upper bound for auto's dtype), from the GGUF's metadata."""
    try:
        from tandem.gguf_index import read_gguf
        from tandem.model.arch import arch_from_gguf_metadata
        from tandem.model_path import resolve_model_path

        tensors, meta = read_gguf(resolve_model_path(model))
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


# -- numbers -------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def finish_run(args: argparse.Namespace, results: dict[str, Any], started: float,
               goals_of: Callable[[dict[str, Any]], Any], plot: Callable[[dict[str, Any], Path], None],
               tables: Callable[[dict[str, Any]], list[Any]],
               issues_of: Callable[[dict[str, Any]], dict[str, list[str]]]) -> int:
    """A finished run of a measurement script: its goals, the JSON, the plot and the tables, then the
    warnings its servers logged."""
    results["wall_s"] = time.monotonic() - started
    results["goals"] = goals_of(results)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.plot)
    out = Console()
    for table in tables(results):
        out.print(table)
    for name, lines in issues_of(results).items():
        out.print(f"[yellow]server log ({name}): {len(lines)} warning/error lines[/], first: {lines[0]}")
    out.print(f"total {results['wall_s'] / 60:.1f} min; results: {args.results}, plot: {args.plot}")
    return 0
