"""Where a step's time goes: the offline-throughput workload driven step by step, with
torch.profiler over a few steps and the time of every step by kind (with prompt tokens or pure decode).

    .venv/bin/python bench/profile_steps.py                       # steps 40-42 (prompt chunks + decodes)
    .venv/bin/python bench/profile_steps.py --skip 95 --steps 3   # pure decode at batch 256

The workload is bench/offline_throughput.py's (random prompts of 64-512 tokens, 128 output tokens,
ignore_eos, max_num_seqs 256). --all runs every request to the end and prints the step totals.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from offline_throughput import random_prompts
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.engine.request import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--skip", type=int, default=40, help="steps to run before profiling")
    ap.add_argument("--steps", type=int, default=3, help="steps to profile")
    ap.add_argument("--all", action="store_true", help="then run to the end and summarise every step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--rows", type=int, default=20, help="profiler table rows")
    args = ap.parse_args()

    llm = LLM(None, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens)
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i, p in enumerate(random_prompts(args.num_prompts, 64, 512, llm.engine.loaded.arch.vocab_size, seed=0)):
        core.add_request(Request(f"r{i}", p, params))

    rows: list[tuple[int, int, float]] = []  # (tokens, requests, seconds) per step

    def step() -> None:
        core.step()
        s = core.last_step
        rows.append((s.num_scheduled_tokens, s.num_requests, s.total_s))

    start = time.perf_counter()
    for _ in range(args.skip):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
            tokens, reqs, sec = rows[-1]
            print(f"step {len(rows)}: {tokens} tokens, {reqs} requests, {sec * 1e3:.0f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.all:
        while core.has_unfinished():
            step()
        elapsed = time.perf_counter() - start
        r = np.array(rows)
        mixed = r[:, 0] > r[:, 1]
        print(f"{len(r)} steps in {elapsed:.1f} s; output {args.num_prompts * 128 / elapsed:.1f} tok/s")
        print(f"  with prompt tokens: {mixed.sum()} steps, {r[mixed, 2].sum():.1f} s")
        print(f"  pure decode:        {(~mixed).sum()} steps, {r[~mixed, 2].sum():.1f} s")


if __name__ == "__main__":
    main()
