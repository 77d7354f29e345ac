"""Part 1 of benchmarks/kv_store.py, multi-turn: chats whose sessions interleave, so that every return finds its
history evicted from the pool."""

from __future__ import annotations

import argparse
import time
from typing import Any

from kv_store_common import CONFIGS, Sizing, blocks
from kv_store_workload import Part, run_workload
from rich.progress import Progress

from tandem.bench.workloads import TextMaker

CHAT_OVERHEAD_PER_MESSAGE = 5  # <|im_start|>role\n ... <|im_end|>\n
CHAT_OVERHEAD_FIXED = 32  # the template's default system message


def multi_turn_sizing(args: argparse.Namespace, block_bytes: int) -> Sizing:
    t, i, o = args.turns, args.turn_input_len, args.turn_output_len
    final = t * i + (t - 1) * o + 2 * t * CHAT_OVERHEAD_PER_MESSAGE + CHAT_OVERHEAD_FIXED + o
    return Sizing(args.conversations * blocks(final), blocks(final), args.max_concurrency, args.pool_ratio,
                  block_bytes)


def run_multi_turn(args: argparse.Namespace, maker: TextMaker, block_bytes: int, progress: Progress) -> dict[str, Any]:
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
    return {"sizing": sizing.as_dict(), "runs": part.runs, "wall_s": time.monotonic() - t0,
            "reusable_share": history / sum(k * i + (k - 1) * o for k in range(1, t + 1))}
