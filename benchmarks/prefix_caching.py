"""Prefix caching on versus off, in one run, on the offline engine with timed arrivals.

    .venv/bin/python benchmarks/prefix_caching.py            # both workloads, caching on and off

(a) shared system prompt: every request is one 1,024-token system prompt plus 64 unique tokens,
    arriving as a Poisson process; (b) five-turn conversations: each turn resends the whole
    history plus a new user message as soon as the previous answer arrives (closed loop).
Reports TTFT p50/p99, the prefix-cache hit rate and throughput; writes
benchmarks/results/prefix_caching.json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tandem import LLM, SamplingParams
from tandem.outputs import RequestOutput

console = Console(stderr=True)


def drive(llm: LLM, arrivals: list[tuple[float, list[int]]], params: SamplingParams,
          follow_up=None) -> tuple[list[RequestOutput], float]:  # noqa: ANN001
    """Feed requests at their arrival offsets; follow_up(output) may return (delay, next prompt)."""
    engine = llm.engine
    start = time.monotonic()
    queue = [(start + t, i, p) for i, (t, p) in enumerate(arrivals)]
    heapq.heapify(queue)
    next_id = len(queue)
    done: list[RequestOutput] = []
    while queue or engine.has_unfinished_requests():
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            at, rid, prompt = heapq.heappop(queue)
            engine.add_request(str(rid), prompt, params, arrival_time=at)
        if not engine.has_unfinished_requests():
            time.sleep(max(queue[0][0] - now, 0))
            continue
        for out in engine.step():
            if out.finished:
                done.append(out)
                nxt = follow_up(out) if follow_up else None
                if nxt is not None:
                    heapq.heappush(queue, (time.monotonic() + nxt[0], next_id, nxt[1]))
                    next_id += 1
    return done, time.monotonic() - start


def summarize(outs: list[RequestOutput], elapsed: float, llm: LLM, before: tuple[int, int]) -> dict:
    ttft = np.array([o.metrics.ttft for o in outs]) * 1e3
    stats = llm.engine.core.scheduler.kv.prefix_stats
    q, h = stats.queries - before[0], stats.hits - before[1]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"requests": len(outs), "duration_s": elapsed, "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "mean_ttft_ms": float(ttft.mean()),
            "prefix_hit_rate": h / q if q else 0.0, "output_throughput": n_out / elapsed,
            "total_throughput": (n_in + n_out) / elapsed}


def shared_prompt_workload(rng: np.random.Generator, n: int, rate: float, vocab: int, prefix_len: int,
                           suffix_len: int) -> list[tuple[float, list[int]]]:
    system = rng.integers(100, vocab, prefix_len).tolist()
    gaps = rng.exponential(1.0 / rate, n)
    return [(float(t), system + rng.integers(100, vocab, suffix_len).tolist()) for t in np.cumsum(gaps) - gaps[0]]


def run(llm: LLM, workload: str, args: argparse.Namespace, vocab: int) -> dict:
    rng = np.random.default_rng(args.seed)
    stats = llm.engine.core.scheduler.kv.prefix_stats
    before = (stats.queries, stats.hits)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if workload == "shared_prompt":
        arrivals = shared_prompt_workload(rng, args.num_prompts, args.request_rate, vocab, args.prefix_len,
                                          args.suffix_len)
        outs, elapsed = drive(llm, arrivals, params)
        return summarize(outs, elapsed, llm, before)
    # Multi-turn: conversation c starts at c * stagger; each turn appends the answer and a new message.
    turns_left = {}
    arrivals = []
    for c in range(args.conversations):
        arrivals.append((c * args.stagger, rng.integers(100, vocab, args.first_turn_len).tolist()))
        turns_left[c] = args.turns - 1
    conv_of: dict[str, int] = {str(c): c for c in range(args.conversations)}
    counter = [args.conversations]

    def follow_up(out: RequestOutput):  # noqa: ANN202
        c = conv_of[out.request_id]
        if turns_left[c] == 0:
            return None
        turns_left[c] -= 1
        conv_of[str(counter[0])] = c
        counter[0] += 1
        history = out.prompt_token_ids + out.outputs[0].token_ids
        return args.think_time, history + rng.integers(100, vocab, args.turn_len).tolist()

    outs, elapsed = drive(llm, arrivals, params, follow_up)
    return summarize(outs, elapsed, llm, before)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-turn-len", type=int, default=512)
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--stagger", type=float, default=0.5)
    ap.add_argument("--think-time", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/prefix_caching.json")
    args = ap.parse_args()

    result: dict = {"config": vars(args)}
    for caching in (True, False):
        llm = LLM(dtype=args.dtype, enable_prefix_caching=caching)
        vocab = llm.engine.loaded.arch.vocab_size
        for workload in ("shared_prompt", "multi_turn"):
            console.print(f"{workload}, prefix caching {'on' if caching else 'off'}")
            result.setdefault(workload, {})["on" if caching else "off"] = run(llm, workload, args, vocab)
        del llm
    table = Table(title="prefix caching: on vs off")
    for col in ("workload", "caching", "TTFT p50 ms", "TTFT p99 ms", "hit rate", "out tok/s", "total tok/s"):
        table.add_column(col, justify="right")
    for workload in ("shared_prompt", "multi_turn"):
        for mode in ("on", "off"):
            r = result[workload][mode]
            table.add_row(workload, mode, f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}",
                          f"{r['prefix_hit_rate']:.1%}", f"{r['output_throughput']:.1f}",
                          f"{r['total_throughput']:.1f}")
        on, off = result[workload]["on"], result[workload]["off"]
        result[workload]["ttft_p50_ratio_on_over_off"] = on["ttft_p50_ms"] / off["ttft_p50_ms"]
    Console().print(table)
    for workload in ("shared_prompt", "multi_turn"):
        print(f"{workload}: TTFT p50 on/off = {result[workload]['ttft_p50_ratio_on_over_off']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
