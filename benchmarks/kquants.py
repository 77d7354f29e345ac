"""Gemma 3 270M's Q4_K_M file served as stored (Q4_K, Q6_K and Q5_0 layers, a Q8_0 embedding and tied
head; a fused qkv that mixes Q5_0 and Q8_0 is dequantized) against the same file dequantized to
float32: the float kernel on each of its layer shapes against F.linear on the dequantized weight, and
one stream's decode step.

    .venv/bin/python benchmarks/kquants.py                # ~3 min on 2 cores
    .venv/bin/python benchmarks/kquants.py --rounds 3     # more alternations of the two models

The two models' steps alternate round by round, since this machine's speed drifts over minutes.
Results go to benchmarks/results/kquants.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from offline_throughput import decode_step_times
from quantization import best, model_linears
from rich.console import Console
from rich.table import Table

from tandem import LLM
from tandem.model.held_weights import weight_bytes, weight_formats
from tandem.model.linear import GGUFMethod
from tandem.model.quant import QuantizedWeight

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
MODEL = "gemma-3-270m"


def kernels(stored: LLM, rows_list: list[int]) -> list[dict]:
    """Each distinct (format, out, in) of the model's block layers, float32 x: the float kernel against
    F.linear on the dequantized float32 weight."""
    seen: dict[tuple, QuantizedWeight] = {}
    for m in model_linears(stored):
        if isinstance(m.method, GGUFMethod):
            w = m.quantized_weight()
            seen.setdefault((w.fmt.name, w.out_features, w.in_features), w)
    out = []
    with torch.inference_mode():
        for (fmt, n, k), w in sorted(seen.items(), key=lambda kv: kv[0][1] * kv[0][2]):
            dense = w.dequantize()
            for rows in rows_list:
                x = torch.randn(rows, k)
                t_kernel = best(lambda x=x, w=w: torch.ops.tandem.gguf_linear(x, w.data, w.fmt.ggml_type,
                                                                              w.in_features, None))
                t_dense = best(lambda x=x, dense=dense: F.linear(x, dense))
                out.append({"format": fmt, "out": n, "in": k, "rows": rows, "kernel_ms": t_kernel * 1e3,
                            "dense_fp32_ms": t_dense * 1e3, "speedup": t_dense / t_kernel,
                            "kernel_gb_s": w.data.numel() / t_kernel / 1e9})
            del dense
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel-rows", default="1,4,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/kquants.json")
    args = ap.parse_args()
    llms = {q: LLM(MODEL, dtype="float32", quantization=q, kv_cache_memory=0.5, enable_prefix_caching=False)
            for q in ("gguf", "none")}
    models = {q: llm.engine.core.runner.model for q, llm in llms.items()}
    result: dict = {"threads": torch.get_num_threads(), "model": MODEL,
                    "weight_mib": {q: weight_bytes(m) / 2**20 for q, m in models.items()},
                    "formats": {q: list(weight_formats(m)) for q, m in models.items()}}
    console.print(f"weights: {result['weight_mib']}; as stored: {result['formats']['gguf']}")
    result["kernels"] = kernels(llms["gguf"], [int(r) for r in args.kernel_rows.split(",")])
    t = Table("format", "out x in", "rows", "kernel ms", "dense fp32 ms", "speed-up", "kernel GB/s")
    for r in result["kernels"]:
        t.add_row(r["format"], f"{r['out']}x{r['in']}", str(r["rows"]), f"{r['kernel_ms']:.3f}",
                  f"{r['dense_fp32_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['kernel_gb_s']:.1f}")
    console.print(t)
    steps: dict[str, list[float]] = {q: [] for q in llms}
    vocab = llms["none"].get_tokenizer().vocab_size
    for _ in range(args.rounds):
        for q, llm in llms.items():
            steps[q].append(decode_step_times(llm, 1, args.context, args.steps, vocab)["step_ms"])
    result["decode_step_ms"] = {q: {"rounds": v, "median": statistics.median(v)} for q, v in steps.items()}
    console.print("one-stream decode step (ms):", {q: v["rounds"] for q, v in result["decode_step_ms"].items()})
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
