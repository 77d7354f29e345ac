"""Part 2 of benchmarks/kv_store.py, Mooncake-trace replay: a synthetic trace of shared documents with Zipf-like
popularity, each request one document plus a unique tail."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from kv_store_common import CONFIGS, Sizing, blocks
from kv_store_workload import Part, run_workload
from rich.progress import Progress

from tandem.bench.workloads import TextMaker

TRACE_BLOCK = 64  # tokens per trace hash id: four KV blocks


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


def run_trace(args: argparse.Namespace, maker: TextMaker, block_bytes: int, progress: Progress) -> dict[str, Any]:
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
    return trace | {"sizing": sizing.as_dict(), "runs": part.runs, "wall_s": time.monotonic() - t0}
