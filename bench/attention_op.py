"""Micro benchmark: compiled paged decode attention vs the PyTorch fallback (one layer, one call).

    python bench/attention_op.py [--threads 2] [--dtype bf16] [--iters 50]

Defaults are SmolLM2-135M shapes (H=9, KVH=3, D=64, bf16, block size 16) with each sequence's blocks
scattered randomly through a pool, as they are after some serving time. GB/s counts the K and V bytes
the call must read (seq_len * KVH * D * 2 tensors), so it compares against memory bandwidth.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tandem.ops import paged_attention as pa  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def make_inputs(
    batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    jitter: float = 0.1, seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # Lengths vary a little around seq_len, like a real decode batch.
    lo, hi = max(1, int(seq_len * (1 - jitter))), max(1, int(seq_len * (1 + jitter)))
    lens = torch.randint(lo, hi + 1, (batch,), generator=g, dtype=torch.int32)
    nblocks = [math.ceil(int(n) / block_size) for n in lens]
    max_blocks = max(nblocks)
    num_blocks = 2 * sum(nblocks)  # a pool twice the live size, blocks taken at random from it
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, lens


def time_ms(fn: Callable[[], object], iters: int, min_time: float = 0.2) -> float:
    for _ in range(3):  # warm up caches, allocator and thread pool
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    op = pa.load_kernel()
    isa = pa.kernel_isa() if op is not None else f"unavailable: {pa.kernel_error() or 'disabled'}"
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, dtype={args.dtype}, "
          f"H={args.heads} KVH={args.kv_heads} D={args.head_dim} block={args.block_size}, kernel: {isa}")

    shapes = [(1, 300), (8, 300), (32, 300), (64, 300), (1, 1000), (8, 1000), (32, 1000)]
    header = f"{'batch':>5} {'seq':>5} {'KV MB':>7} | {'kernel ms':>9} {'GB/s':>6} | {'torch ms':>9} {'GB/s':>6} | {'speedup':>7}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for batch, seq in shapes:
            q, k, v, tables, lens = make_inputs(batch, seq, args.heads, args.kv_heads, args.head_dim,
                                                args.block_size, dtype)
            scale = args.head_dim**-0.5
            nbytes = 2 * int(lens.sum()) * args.kv_heads * args.head_dim * k.element_size()
            t_torch = time_ms(lambda: pa.paged_decode_attention_torch(q, k, v, tables, lens, scale), args.iters)
            row = f"{batch:>5} {seq:>5} {nbytes / 1e6:>7.2f} | "
            if op is not None:
                t_kern = time_ms(lambda: op(q, k, v, tables, lens, scale), args.iters)
                row += f"{t_kern:>9.3f} {nbytes / t_kern / 1e6:>6.1f} | "
            else:
                row += f"{'-':>9} {'-':>6} | "
            row += f"{t_torch:>9.3f} {nbytes / t_torch / 1e6:>6.1f} | "
            row += f"{t_torch / t_kern:>6.1f}x" if op is not None else f"{'-':>7}"
            print(row)


if __name__ == "__main__":
    main()
