"""The model's linear layers at a few rows to a prompt chunk's, oneDNN's packed matmul vs the compiled
small_batch_linear (the panels every bf16 layer holds):

    .venv/bin/python benchmarks/small_batch_linear.py               # default model, rows 1-48
    .venv/bin/python benchmarks/small_batch_linear.py --rows 1,8,16,32,128,512,2048 --rounds 4

Both paths are timed alternately in one process (this machine's speed drifts over minutes), and
each repetition calls every linear layer of the model once plus the lm_head, as a decode step does;
GB/s counts the bf16 weights read. Where the model holds no oneDNN copy (the panels serve every row:
no AMX), the benchmark packs one from the panels. Whole decode steps: benchmarks/decode_roofline.py.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem import LLM
from tandem.model.packed_linear import BATCH_HINT, PackedLinear


def unpacked(m: PackedLinear) -> torch.Tensor:
    """The [out, in] bf16 weight back from small_batch_linear's panels [P, K/2, 32, 2]."""
    p = m.panels
    return p.permute(0, 2, 1, 3).reshape(p.shape[0] * p.shape[2], m.in_features)[:m.out_features]


def with_onednn_copies(layers: list[PackedLinear]) -> None:
    """Give every layer oneDNN's packed copy (where the panels serve every row it holds none)."""
    for m in layers:
        if m.packed_weight is None:
            m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(unpacked(m).contiguous(), BATCH_HINT)


def time_linears(layers: list[PackedLinear], rows: int, small: bool) -> float:
    xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in {m.in_features for m in layers}}
    t = time.perf_counter()
    for m in layers:
        x = xs[m.in_features]
        if small:
            torch.ops.tandem.small_batch_linear(x, m.panels, m.bias, m.out_features)
        else:
            torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, m.bias, "none", [], "")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", default="1,2,4,8,16,32,48")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", quantization="none")
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, PackedLinear)]
    if not layers or layers[0].panels is None:
        raise SystemExit("small_batch_linear is unavailable here (needs the compiled ops and AVX512-BF16)")
    with_onednn_copies(layers)
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

if __name__ == "__main__":
    main()
