"""A prompt's linear layers on weights as stored (issue #46, part 2): the int8-activation kernel
(`gguf_linear_q8`, what `auto` serves past 1 GiB of dense weights) at a prompt chunk's rows, against
one GEMM on the same weights dequantized (float32 `F.linear`, or bfloat16 where the CPU has
AVX512-BF16: what the dense model runs), in multiply-adds per second.

    .venv/bin/python benchmarks/quant_prefill.py                        # 1B and 3B shapes, 4-1024 rows
    .venv/bin/python benchmarks/quant_prefill.py --models 1b --rows 256

Each kernel runs on one copy of each layer's weight (a prompt's compute, not its weight bytes, sets
the time here), best of five. Formats as llama.cpp's Q4_K_M puts them (Q4_K, Q6_K) and Q4_0, Q8_0.
Results: benchmarks/results/quant_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from quant_gemv import FORMATS, MODELS, fmt_named, random_blocks
from rich.console import Console
from rich.table import Table

from tandem.ops import extension

console = Console(stderr=True)
RESULTS = Path(__file__).resolve().parent / "results" / "quant_prefill.json"


def best_seconds(call, reps: int = 5) -> float:  # noqa: ANN001
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,3b")
    ap.add_argument("--rows", default="4,16,256,1024")
    args = ap.parse_args()
    assert extension.load_extension(), "the kernels did not build"
    bf16 = "bf16" in (extension.extension_isa() or "")
    dense_dtype = torch.bfloat16 if bf16 else torch.float32
    results = []
    for model in args.models.split(","):
        for fmt_name, layers in FORMATS.items():
            fmt = fmt_named(fmt_name)
            for name, n, k in MODELS[model]:
                if name not in layers or name == "lm_head":  # a prompt's head runs on its last row only
                    continue
                w = random_blocks(fmt, n, k, 0)
                dense = torch.ops.tandem.gguf_dequantize(w, fmt.ggml_type, k).to(dense_dtype)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k)
                    xd = x.to(dense_dtype)
                    q8 = best_seconds(lambda x=x, w=w, fmt=fmt, k=k: torch.ops.tandem.gguf_linear_q8(
                        x, w, fmt.ggml_type, k, None))
                    gemm = best_seconds(lambda xd=xd, dense=dense: torch.nn.functional.linear(xd, dense))
                    macs = rows * n * k
                    results.append({"model": model, "format": fmt_name, "layer": name, "shape": [n, k], "rows": rows,
                                    "q8_s": q8, "dense_s": gemm, "q8_gmacs": macs / q8 / 1e9,
                                    "dense_gmacs": macs / gemm / 1e9})
    dense_name = "bf16" if bf16 else "f32"
    table = Table(title=f"multiply-adds per second (G), {torch.get_num_threads()} threads; dense: {dense_name} GEMM")
    for col in ("model", "format", "layer", "rows", "q8", f"{dense_name} GEMM", "q8 / GEMM time", "q8 ms"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["model"], r["format"], r["layer"], str(r["rows"]), f"{r['q8_gmacs']:.0f}",
                      f"{r['dense_gmacs']:.0f}", f"{r['q8_s'] / r['dense_s']:.2f}", f"{r['q8_s'] * 1e3:.2f}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "isa": extension.extension_isa(), "dense": dense_name,
                                   "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
