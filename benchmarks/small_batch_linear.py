"""Decode at low concurrency: the model's linear layers at a few rows, oneDNN's packed matmul vs
the compiled small_batch_linear, and the engine's decode step with each.

    .venv/bin/python benchmarks/small_batch_linear.py               # default model, rows 1-48
    .venv/bin/python benchmarks/small_batch_linear.py --rounds 10

Both paths are timed alternately in one process (this machine's speed drifts over minutes), and
each repetition calls every linear layer of the model once plus the lm_head, as a decode step does;
GB/s counts the bf16 weights read. The engine part times pure decode steps (context 256) at
batch 1-32 with PackedLinear's switch at 0 rows (oneDNN only) and at its default (32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tandem import LLM, SamplingParams
from tandem.engine.request import Request
from tandem.model import packed_linear
from tandem.model.packed_linear import PackedLinear


def time_linears(layers: list[PackedLinear], rows: int, small: bool) -> float:
    packed_linear.SMALL_BATCH_ROWS = rows if small else 0
    xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in {m.in_features for m in layers}}
    t = time.perf_counter()
    for m in layers:
        m(xs[m.in_features])
    return time.perf_counter() - t


def decode_step_ms(llm: LLM, batch: int, steps: int) -> float:
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    rng = np.random.default_rng(batch)
    vocab = llm.engine.loaded.arch.vocab_size
    for i in range(batch):
        core.add_request(Request(f"b{batch}-{i}-{time.monotonic_ns()}", rng.integers(100, vocab, 256).tolist(), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    times = []
    for _ in range(steps):
        core.step()
        times.append(core.last_step.total_s)
    core.abort(list(core.scheduler.requests))
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", default="1,2,4,8,16,32,48")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", quantization="none")
    default_rows = packed_linear.SMALL_BATCH_ROWS
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, PackedLinear)]
    if not layers or layers[0].panels is None:
        raise SystemExit("small_batch_linear is unavailable here (needs the compiled ops and AVX512-BF16)")
    weight_bytes = sum(m.in_features * m.out_features * 2 for m in layers)
    print(f"{len(layers)} linear layers, {weight_bytes / 1e6:.0f} MB of bf16 weights; best of {args.rounds} rounds")
    print(f"{'rows':>4} | {'oneDNN ms':>9} {'GB/s':>5} | {'small ms':>8} {'GB/s':>5} | speedup")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            onednn, small = [], []
            for _ in range(args.rounds):
                onednn.append(time_linears(layers, rows, small=False))
                small.append(time_linears(layers, rows, small=True))
            a, b = min(onednn), min(small)
            print(f"{rows:>4} | {a * 1e3:>9.1f} {weight_bytes / a / 1e9:>5.1f} | {b * 1e3:>8.1f} "
                  f"{weight_bytes / b / 1e9:>5.1f} | {a / b:.2f}x", flush=True)
    print(f"\ndecode step (context 256), median ms; switch at 0 rows vs {default_rows}")
    print(f"{'batch':>5} | {'oneDNN':>7} | {'small':>7} | speedup")
    for batch in (int(b) for b in args.batches.split(",")):
        onednn, small = [], []
        for _ in range(max(2, args.rounds // 3)):
            packed_linear.SMALL_BATCH_ROWS = 0
            onednn.append(decode_step_ms(llm, batch, 10))
            packed_linear.SMALL_BATCH_ROWS = default_rows
            small.append(decode_step_ms(llm, batch, 10))
        a, b = min(onednn), min(small)
        print(f"{batch:>5} | {a:>7.1f} | {b:>7.1f} | {a / b:.2f}x", flush=True)
    packed_linear.SMALL_BATCH_ROWS = default_rows


if __name__ == "__main__":
    main()
