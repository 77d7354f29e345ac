"""Where a step's time goes: the offline-throughput workload driven step by step, with
torch.profiler over a few steps and the time of every step by kind (with prompt tokens or pure decode).

    .venv/bin/python benchmarks/profile_steps.py                       # steps 40-42 (prompt chunks + decodes)
    .venv/bin/python benchmarks/profile_steps.py --skip 95 --steps 3   # pure decode at batch 256

The workload is benchmarks/offline_throughput.py's (random prompts of 64-512 tokens, 128 output tokens,
ignore_eos, max_num_seqs 256). --all runs every request to the end and prints the step totals.

--floor (with --all) then measures what no bf16 engine can beat on this machine for the same run:
  * matmuls: every step's token count replayed through every decoder layer's linears, plus the
    lm_head for the 256 x 128 sampled rows (timed at 256 rows), best of 3 per distinct step size;
  * decode KV reads: the bytes every decode token's attention must read (its whole context, K and
    V, every layer) at the best streaming read rate measured here (a 1 GiB sum, best of 3).
    .venv/bin/python benchmarks/profile_steps.py --all --floor
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
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
    ap.add_argument("--floor", action="store_true", help="with --all: measure the matmul and KV-read floor")
    args = ap.parse_args()

    llm = LLM(None, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens)
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompts = random_prompts(args.num_prompts, 64, 512, llm.engine.loaded.arch.vocab_size, seed=0)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))

    rows: list[tuple[int, int, float]] = []  # (tokens, requests, seconds) per step

    def step() -> None:
        core.step()
        s = core.meter.last_step
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
        if args.floor:
            print_floor(llm, r, [len(p) for p in prompts], params.max_tokens, elapsed)


def _best_time(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def print_floor(llm: LLM, rows: np.ndarray, prompt_lens: list[int], out_len: int, engine_s: float) -> None:
    model = llm.engine.core.runner.model
    arch = model.cfg
    linears = [(m, m.in_features) for layer in model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    dtype = model.norm.weight.dtype
    per_tokens: dict[int, float] = {}
    with torch.inference_mode():
        for t in sorted({int(x) for x in rows[:, 0]}):
            xs = {n: torch.randn(t, n).to(dtype) for n in {n for _, n in linears}}
            per_tokens[t] = _best_time(lambda xs=xs: [lin(xs[n]) for lin, n in linears])
        sampled = len(prompt_lens) * out_len
        x = torch.randn(256, arch.hidden_size).to(dtype)
        lm_head_s = _best_time(lambda: model.lm_head(x)) * sampled / 256
    layers_s = sum(per_tokens[int(t)] for t in rows[:, 0])
    # Output token i >= 1 of a request comes from a decode step over its prompt plus i tokens.
    kv_tokens = sum(p + i for p in prompt_lens for i in range(1, out_len))
    kv_bytes = kv_tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    buf = torch.ones(1 << 28)  # 1 GiB of float32
    read_gbs = buf.numel() * 4 / _best_time(buf.sum) / 1e9
    kv_s = kv_bytes / (read_gbs * 1e9)
    floor = layers_s + lm_head_s + kv_s
    print(f"floor: decoder-layer matmuls {layers_s:.1f} s + lm_head {lm_head_s:.1f} s"
          f" + decode KV reads {kv_bytes / 1e9:.0f} GB at {read_gbs:.1f} GB/s = {kv_s:.1f} s -> {floor:.1f} s")
    print(f"engine time {engine_s:.1f} s is {engine_s / floor:.2f}x the floor;"
          f" outside the floor (attention compute, norms, sampling, scheduling): {engine_s - floor:.1f} s")


if __name__ == "__main__":
    main()
