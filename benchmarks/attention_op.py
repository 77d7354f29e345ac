"""Micro benchmark: compiled paged decode attention vs the PyTorch fallback (one layer per call).

    python benchmarks/attention_op.py [--threads 2] [--dtype bf16] [--cold-mb 1024]

Defaults are SmolLM2-135M shapes (H=9, KVH=3, D=64, bf16, block size 16) with each sequence's blocks
scattered randomly through a pool twice the live size, as after some serving time. Two timings:
  hot:  the same layer's cache called repeatedly (it stays in the large L3 of server CPUs);
  cold: calls cycle through enough copies of the cache (--cold-mb) that it comes from DRAM, as in a
        real model where every layer has its own cache. The copies sit on huge pages, as the
        engine's pool does (tandem.kv.host_memory).
  cold 4k (--compare-pages): the same on ordinary 4 KiB pages, timed right after.
GB/s counts the K and V bytes a call must read (sum of seq_len * KVH * D * 2 tensors). Times are
the best repetition (--stat min, default: robust to other processes taking a core, which stalls a
whole multi-threaded call for a scheduler tick) or the median (--stat median, for a quiet machine).
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

from tandem.kv.host_memory import huge_page_zeros  # noqa: E402
from tandem.ops import extension  # noqa: E402
from tandem.ops import paged_attention as pa  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
Attn = Callable[..., torch.Tensor]


def make_inputs(
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    jitter: float = 0.1,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, block_tables, seq_lens with blocks scattered through the pool."""
    g = torch.Generator().manual_seed(seed)
    # Lengths vary a little around seq_len, like a real decode batch.
    lo, hi = max(1, int(seq_len * (1 - jitter))), max(1, int(seq_len * (1 + jitter)))
    lens = torch.randint(lo, hi + 1, (batch,), generator=g, dtype=torch.int32)
    nblocks = [math.ceil(int(n) / block_size) for n in lens]
    num_blocks = 2 * sum(nblocks)  # a pool twice the live size, blocks taken at random from it
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(batch, max(nblocks), dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[pos : pos + nb]
        pos += nb
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, lens


def time_layers(
    fn: Attn,
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    min_reps: int,
    stat: str,
    min_time: float = 0.2,
) -> float:
    """ms per call (min or median over repetitions), each repetition calling each (k, v) cache once."""
    for k, v in caches[:3]:  # warm up allocator, thread pool, code
        fn(q, k, v, tables, lens, scale)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        for k, v in caches:
            fn(q, k, v, tables, lens, scale)
        samples.append((time.perf_counter() - t0) / len(caches))
    return (min(samples) if stat == "min" else statistics.median(samples)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20, help="minimum repetitions per timing")
    ap.add_argument("--cold-mb", type=int, default=1024, help="cache copies cycled for 'cold' (0: skip)")
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) fallback timings")
    ap.add_argument("--stat", choices=["min", "median"], default="min")
    ap.add_argument("--compare-pages", action="store_true", help="also time the cold caches on 4 KiB pages")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    op = extension.op("paged_decode_attention")
    kernel: Attn | None = None
    if op is not None:
        kernel = lambda q, k, v, t, n, s: op(q, k, v, t, n, s)  # noqa: E731 - same signature as torch path
        isa = extension.extension_isa()
    else:
        isa = f"unavailable: {extension.extension_error() or 'disabled'}"
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, dtype={args.dtype}, H={args.heads} "
          f"KVH={args.kv_heads} D={args.head_dim} block={args.block_size}, kernel: {isa}, stat={args.stat}")

    impls: list[tuple[str, Attn | None]] = [("kernel", kernel)]
    if not args.no_torch:
        impls.append(("torch", pa.paged_decode_attention_torch))
    modes = ["hot"] + (["cold"] if args.cold_mb > 0 else []) + (["cold 4k"] if args.compare_pages else [])
    cols = [f"{name} {mode}" for name, _ in impls for mode in modes]
    header = f"{'batch':>5} {'seq':>5} {'KV MB':>6} |" + "|".join(f" {c:>11} ms  GB/s " for c in cols)
    print(header)
    print("-" * len(header))

    shapes = [(1, 300), (8, 300), (32, 300), (64, 300), (1, 1000), (8, 1000), (32, 1000)]
    with torch.inference_mode():
        for batch, seq in shapes:
            q, k, v, tables, lens = make_inputs(batch, seq, args.heads, args.kv_heads, args.head_dim,
                                                args.block_size, dtype)
            scale = args.head_dim**-0.5
            nbytes = 2 * int(lens.sum()) * args.kv_heads * args.head_dim * k.element_size()
            pool_bytes = 2 * k.numel() * k.element_size()
            copies = max(2, math.ceil(args.cold_mb * 2**20 / pool_bytes)) if args.cold_mb else 0
            cold = [(on_huge_pages(k), on_huge_pages(v)) for _ in range(copies)]
            cold_4k = [(k.clone(), v.clone()) for _ in range(copies)] if args.compare_pages else []
            row = f"{batch:>5} {seq:>5} {nbytes / 1e6:>6.2f} |"
            times: dict[str, float] = {}
            for name, fn in impls:
                for mode in modes:
                    if fn is None:
                        row += f" {'-':>11}    {'-':>5} |"
                        continue
                    caches = {"hot": [(k, v)], "cold": cold, "cold 4k": cold_4k}[mode]
                    reps = args.iters if mode == "hot" else max(3, args.iters // 4)
                    ms = time_layers(fn, q, caches, tables, lens, scale, reps, args.stat)
                    times[f"{name} {mode}"] = ms
                    row += f" {ms:>11.3f}    {nbytes / ms / 1e6:>5.1f} |"
            if "kernel hot" in times and "torch hot" in times:
                row += f" {times['torch hot'] / times['kernel hot']:.1f}x"
            print(row, flush=True)
            del cold, cold_4k


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    return huge_page_zeros(tuple(t.shape), t.dtype).copy_(t)


if __name__ == "__main__":
    main()
