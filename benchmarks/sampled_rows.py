"""A step of prompt chunks with the last layer run for every row vs for the sampled rows only.

    .venv/bin/python benchmarks/sampled_rows.py [--rounds 12]

One forward pass of the default model over 1,024 new tokens (four prompt chunks, two of them after
cached context), logits for each chunk's last row. "all rows" is the metadata without
logits_indices (every layer computes every row, the logits rows are picked at the end); "sampled
rows" lets the last layer store every row's K/V and run attention, o_proj and the MLP for the four
sampled rows only. Both alternate in one process; times are medians. It also prints how far the two
paths' logits are apart (bf16: different kernels round differently) and whether their argmax agrees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tandem import LLM
from tandem.model.attention import build_attention_metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(None, dtype=args.dtype, kv_cache_memory=1)
    runner = llm.engine.core.runner
    model, kv, bs = runner.model, runner.kv_caches, runner.block_size
    q_lens, ctx = np.array([300, 200, 400, 124]), np.array([0, 100, 0, 50])
    tables = np.arange(4 * 40, dtype=np.int32).reshape(4, 40)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, model.cfg.vocab_size, int(q_lens.sum())))
    rows = np.cumsum(q_lens) - 1
    idx = torch.from_numpy(rows)
    device = torch.device("cpu")
    paths = {"all rows": build_attention_metadata(q_lens, ctx, tables, 0, bs, device),
             "sampled rows": build_attention_metadata(q_lens, ctx, tables, 0, bs, device, rows)}
    full, sampled = (model(ids, meta, kv, idx).float() for meta in paths.values())
    print(f"logits max |diff| {float((full - sampled).abs().max()):.4f}, "
          f"argmax equal: {bool((full.argmax(-1) == sampled.argmax(-1)).all())}")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, meta in paths.items():
            t0 = time.perf_counter()
            model(ids, meta, kv, idx)
            times[name].append(time.perf_counter() - t0)
    a, s = (statistics.median(times[n]) * 1e3 for n in paths)
    print(f"{int(q_lens.sum())}-token prompt step: all rows {a:.1f} ms, sampled rows {s:.1f} ms ({a / s:.3f}x)")


if __name__ == "__main__":
    main()
