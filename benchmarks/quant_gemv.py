"""The linear kernels a decode step runs, at the layer shapes of the models people serve, against this
machine's read bandwidth (issue #46): weight bytes per second of each kernel over a native streaming
read's (tandem::stream_read, wide loads over 1 GiB), measured in the same run.

    .venv/bin/python benchmarks/quant_gemv.py                       # Llama-3.2-1B and 3B shapes, 1/4/8 rows
    .venv/bin/python benchmarks/quant_gemv.py --models 1b --rows 1

Kernels, each on weights well past the last-level cache (a layer's matrices are cycled so that no
call finds its weight in cache):
  q8        gguf_linear_q8: int8 activations (K-quants per 256, llama.cpp's arithmetic)
  x16       the same on Q4_K and Q6_K blocks interleaved by 16 rows (what `auto` holds on AVX512-VNNI;
            "-" where this CPU has no kernel for the layout)
  float     gguf_linear: the blocks dequantized in registers, float activations
  dense     small_batch_linear on the same matrix dequantized to bfloat16 (what `auto` serves
            in bfloat16): 3.6x the bytes of Q4_K; without AVX512-BF16, F.linear on it in float32
Formats as llama.cpp's Q4_K_M puts them: Q4_K for most matrices, Q6_K for the output layer (and
half of attn_v / ffn_down), plus Q4_0 and Q8_0. Random blocks with valid scales: speed only.
Results: benchmarks/results/quant_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch
from quantization import bandwidth, best
from rich.console import Console
from rich.table import Table

from tandem.model.block_formats import INTERLEAVED16_FORMATS, NATIVE_FORMATS, BlockFormat
from tandem.model.linear import interleavable
from tandem.ops import extension

console = Console(stderr=True)
RESULTS = Path(__file__).resolve().parent / "results" / "quant_gemv.json"

# (name, out_features, in_features) of each distinct decode-step matrix; the vocabulary is Llama 3's.
MODELS = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)],
    "3b": [("qkv", 5120, 3072), ("o", 3072, 3072), ("gate_up", 16384, 3072), ("down", 3072, 8192),
           ("lm_head", 128256, 3072)],
}
FORMATS = {"Q4_K": ["qkv", "o", "gate_up", "down"], "Q6_K": ["down", "lm_head"], "Q4_0": ["gate_up"],
           "Q8_0": ["gate_up"]}
MIN_BYTES = 1 << 30  # each kernel's weights cycled over at least this many bytes


def fmt_named(name: str) -> BlockFormat:
    return next(f for f in NATIVE_FORMATS.values() if f.name == name)


def random_blocks(fmt: BlockFormat, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random quants with every fp16 scale set to a small normal value (random bits could be NaN)."""
    rng = np.random.default_rng(seed)
    nb = in_features // fmt.block_weights
    data = rng.integers(0, 256, (out_features, nb, fmt.block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    offsets = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2]}.get(fmt.name, [0])
    for off in offsets:
        data[:, :, off:off + 2] = scale
    return torch.from_numpy(data.reshape(out_features, nb * fmt.block_bytes))


def cycled(make, nbytes: int) -> list:  # noqa: ANN001
    """Copies of a weight (make(i)) until they hold MIN_BYTES, so that calls in turn miss the cache."""
    return [make(i) for i in range(max(2, -(-MIN_BYTES // nbytes)))]


def kernel_rate(weights: list, call, x: torch.Tensor, nbytes: int) -> float:  # noqa: ANN001
    """Weight bytes per second: each pass calls the kernel once on every copy."""

    def run() -> None:
        for w in weights:
            call(x, w)

    return nbytes * len(weights) / best(run, reps=3, min_s=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,3b")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="the kernels in turn, the best of this many rounds each")
    args = ap.parse_args()
    assert extension.load_extension(), "the kernels did not build"
    torch.manual_seed(0)
    bw = bandwidth()
    console.print(f"streaming read: {bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    rows_list = [int(r) for r in args.rows.split(",")]
    bf16 = "bf16" in (extension.extension_isa() or "")
    results = []
    for model in args.models.split(","):
        for fmt_name, layers in FORMATS.items():
            fmt = fmt_named(fmt_name)
            for name, n, k in MODELS[model]:
                if name not in layers:
                    continue
                qbytes = n * k // fmt.block_weights * fmt.block_bytes
                first = random_blocks(fmt, n, k, 0)
                qs = cycled(lambda i, first=first: first.clone(), qbytes)
                x16 = None
                if interleavable(fmt, n):
                    x16 = [q.clone() for q in qs]
                    for q in x16:
                        torch.ops.tandem.gguf_interleave16_(q, fmt.ggml_type, k)
                dense = torch.ops.tandem.gguf_dequantize(first, fmt.ggml_type, k)
                if bf16:
                    one = torch.ops.tandem.pack_linear_weight(dense.to(torch.bfloat16))
                    del dense
                    dense_bytes = 2 * n * k
                    packed = cycled(lambda i, one=one: one.clone(), dense_bytes)
                else:  # no AVX512-BF16: the dense form is float32 (what `auto` serves here), through F.linear
                    one, dense_bytes = dense, 4 * n * k
                    packed = cycled(lambda i, one=one: one.clone(), dense_bytes)
                for rows in rows_list:
                    x = torch.randn(rows, k, dtype=torch.bfloat16 if bf16 else torch.float32)
                    dense_call = ((lambda x, w, n=n: torch.ops.tandem.small_batch_linear(x, w, None, n)) if bf16
                                  else (lambda x, w: torch.nn.functional.linear(x, w)))
                    calls = {
                        "q8": (qs, lambda x, w, fmt=fmt, k=k: torch.ops.tandem.gguf_linear_q8(
                            x, w, fmt.ggml_type, k, None), qbytes),
                        "float": (qs, lambda x, w, fmt=fmt, k=k: torch.ops.tandem.gguf_linear(
                            x, w, fmt.ggml_type, k, None), qbytes),
                        "dense": (packed, dense_call, dense_bytes),
                    }
                    if x16 is not None:
                        code = INTERLEAVED16_FORMATS[fmt].ggml_type
                        calls["x16"] = (x16, lambda x, w, code=code, k=k: torch.ops.tandem.gguf_linear_q8(
                            x, w, code, k, None), qbytes)
                    # The kernels in turn, the best of --rounds rounds each: a VM's read rate moves between
                    # minutes, and a comparison should not hinge on which kernel ran when.
                    rates = {key: 0.0 for key in calls}
                    for _ in range(args.rounds):
                        for key, (weights, call, nbytes) in calls.items():
                            rates[key] = max(rates[key], kernel_rate(weights, call, x, nbytes))
                    results.append({"model": model, "format": fmt_name, "layer": name, "shape": [n, k],
                                    "rows": rows, "weight_bytes": qbytes, "bytes_per_s": rates,
                                    "of_bandwidth": {key: v / bw for key, v in rates.items()},
                                    "seconds": {"q8": qbytes / rates["q8"], "float": qbytes / rates["float"],
                                                "dense": dense_bytes / rates["dense"],
                                                **({"x16": qbytes / rates["x16"]} if "x16" in rates else {})}})
                del qs, packed, one, first, x16
    dense = "bf16" if bf16 else "f32"
    table = Table(title=f"weight bytes/s over the streaming read ({bw / 1e9:.1f} GB/s); time per call, ms")
    for col in ("model", "format", "layer", "rows", "q8", "x16", "float", f"{dense} (dequantized)", "q8 ms", "x16 ms",
                "float ms", f"{dense} ms"):
        table.add_column(col, justify="right")
    for r in results:
        f, s = r["of_bandwidth"], r["seconds"]
        x16 = (f"{f['x16']:.0%}", f"{s['x16'] * 1e3:.2f}") if "x16" in f else ("-", "-")
        table.add_row(r["model"], r["format"], r["layer"], str(r["rows"]), f"{f['q8']:.0%}", x16[0],
                      f"{f['float']:.0%}", f"{f['dense']:.0%}", f"{s['q8'] * 1e3:.2f}", x16[1],
                      f"{s['float'] * 1e3:.2f}", f"{s['dense'] * 1e3:.2f}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "isa": extension.extension_isa(), "dense": dense,
                                   "threads": torch.get_num_threads(),
                                   "bandwidth_bytes_per_s": bw, "results": results}, indent=1))


if __name__ == "__main__":
    main()
