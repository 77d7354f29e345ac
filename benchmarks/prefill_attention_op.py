"""Micro benchmark: one layer's attention for a step of prompt chunks, compiled kernel vs fallback.

    python benchmarks/prefill_attention_op.py [--threads 2] [--dtype bf16]

Each row is a batch of multi-token queries as the scheduler packs them: (context, new tokens) per
request, blocks scattered through the pool. Three timings of the same layer:
  kernel:   tandem.model.attention.paged_attention with the compiled ops (writes the new K/V into
            the pool, then the paged prefill kernel: AMX brgemm for bf16 where available);
  fallback: the same call with TANDEM_DISABLE_KERNELS=1 (one padded causal SDPA for fresh prompts,
            gather + masked SDPA for chunks with context);
  flash:    PyTorch's flash SDPA per request on dense, unpaged K/V: no pool, no packing, a Python
            loop over requests; a reference point, not something an engine can call as is.
GF/s counts the useful (causal) attention FLOPs: 4 * heads * head_dim * sum of q_len * (context +
(q_len + 1) / 2). Times are the median of repetitions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tandem.model.attention import build_attention_metadata, paged_attention
from tandem.ops import extension

BATCHES: dict[str, list[tuple[int, int]]] = {
    "one 512 prompt": [(0, 512)],
    "three fresh prompts": [(0, 300), (0, 450), (0, 274)],
    "chunk after 200 cached": [(200, 312)],
    "one 1024 prompt": [(0, 1024)],
    "eight 64-token prompts": [(0, 64)] * 8,
    "mixed step": [(0, 300), (512, 200), (0, 100), (96, 300)],
}


def median_ms(fn: Callable[[], object], min_reps: int = 10, min_time: float = 0.3) -> float:
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, {args.dtype}, H={h} KVH={kvh} D={d} "
          f"block={bs}, kernels: {extension.extension_isa() if extension.load_extension() else 'unavailable'}")
    print(f"{'batch (context, new)':<26} {'tokens':>6} | {'kernel ms':>9} {'GF/s':>5} | {'fallback ms':>11} "
          f"{'GF/s':>5} | {'flash ms':>8} {'GF/s':>5} | kernel speedup")
    g = torch.Generator().manual_seed(0)
    for name, seqs in BATCHES.items():
        measure(name, seqs, h, kvh, d, bs, dtype, g)

def measure(name: str, seqs: list[tuple[int, int]], h: int, kvh: int, d: int, bs: int, dtype: torch.dtype,
            g: torch.Generator) -> None:
    """Time one batch three ways and print its row."""
    ctx = np.array([c for c, _ in seqs])
    q_lens = np.array([n for _, n in seqs])
    nblocks = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = 2 * sum(nblocks)
    perm = torch.randperm(num_blocks, generator=g).numpy().astype(np.int32)
    tables = np.zeros((len(seqs), max(nblocks)), dtype=np.int32)
    used = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    t = int(q_lens.sum())
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)
    flops = 4 * h * d * float(sum(n * (c + (n + 1) / 2) for c, n in seqs))

    def layer() -> torch.Tensor:
        meta = build_attention_metadata(q_lens, ctx, tables, 0, bs, torch.device("cpu"))
        return paged_attention(q, k, v, k_cache, v_cache, meta, d**-0.5)

    dense = [(torch.randn(1, h, n, d, generator=g).to(dtype), torch.randn(1, kvh, c + n, d, generator=g).to(dtype))
             for c, n in seqs]

    def flash() -> None:
        for qq, kk in dense:  # bottom-right causal equals top-left only without context; cost is what matters
            F.scaled_dot_product_attention(qq, kk, kk, is_causal=True, enable_gqa=kvh != h)

    with torch.inference_mode():
        kernel_ms = median_ms(layer)
        os.environ["TANDEM_DISABLE_KERNELS"] = "1"
        try:
            fallback_ms = median_ms(layer)
        finally:
            del os.environ["TANDEM_DISABLE_KERNELS"]
        flash_ms = median_ms(flash)
    print(f"{name:<26} {t:>6} | {kernel_ms:>9.2f} {flops / kernel_ms / 1e6:>5.0f} | {fallback_ms:>11.2f} "
          f"{flops / fallback_ms / 1e6:>5.0f} | {flash_ms:>8.2f} {flops / flash_ms / 1e6:>5.0f} | "
          f"{fallback_ms / kernel_ms:.1f}x", flush=True)


if __name__ == "__main__":
    main()
