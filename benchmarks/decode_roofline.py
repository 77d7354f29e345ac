"""Decode steps against this machine's roofline, with the native layer stack and with the Python
layer loop, side by side in one process (issue #32).

    .venv/bin/python benchmarks/decode_roofline.py                          # batches 1-128, contexts 256, 1024
    .venv/bin/python benchmarks/decode_roofline.py --batches 1,8 --contexts 256 --dtype float32
    .venv/bin/python benchmarks/decode_roofline.py --model ~/.cache/tandem/models/llama-3.2-3b-shape-Q4_K_M.gguf \
        --batches 1,8,32 --contexts 256          # a model at a real size (benchmarks/model_shapes.py)

The floors are measured here, in this run: the streaming read rate (a sum over 1 GiB, again before each
batch and context: a VM's rate can move by half between minutes) and the matmul rate in the model's dtype
(F.linear at 1,024 rows of the model's shapes). A step's roofline
is the larger of its bytes at that rate and its FLOPs at the matmul rate. Its bytes are every
weight it reads once, in the form it reads it (a bf16 linear's panels or oneDNN copy, never both;
GGUF blocks as stored), plus every request's K/V; its FLOPs are the linears' and attention's. For
each batch and context the two layer loops alternate, step by step, so the machine's drift hits
both alike. Results: benchmarks/results/decode_roofline.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from quantization import bandwidth, matmul_rate, model_linears
from rich.console import Console
from rich.table import Table

from tandem import LLM, SamplingParams
from tandem.engine.kv_layout import engine_kv_layout
from tandem.engine.request import Request
from tandem.model.linear import Linear

console = Console(stderr=True)
RESULTS = Path(__file__).resolve().parent / "results" / "decode_roofline.json"


def bytes_read(linear: Linear) -> int:
    """The bytes one product with this layer reads: its weight in the one form a step uses."""
    blocks = [b for name, b in linear.named_buffers() if name.startswith("qdata")]  # gguf, gguf-split's runs
    if blocks:
        return sum(b.numel() for b in blocks)
    return linear.in_features * linear.out_features * torch.tensor([], dtype=linear.dtype).element_size()


def step_floor(llm: LLM, batch: int, context: int, bw: float, rate: float) -> tuple[float, float, float]:
    """(bytes, FLOPs, roofline seconds) of a decode step of `batch` requests at `context` tokens."""
    model = llm.engine.core.runner.model
    arch = model.cfg
    linears = model_linears(llm)
    params = sum(m.in_features * m.out_features for m in linears)
    attn = 4 * batch * context * arch.num_heads * arch.head_dim * arch.num_layers
    kv = batch * context * engine_kv_layout(llm.engine.config, arch).bytes_per_token(arch)
    nbytes = sum(bytes_read(m) for m in linears) + kv
    flops = 2 * params * batch + attn
    return nbytes, flops, max(nbytes / bw, flops / rate)


def alternate(llm: LLM, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median decode-step time with the stack and with the Python loop, alternating step by step."""
    core, model = llm.engine.core, llm.engine.core.runner.model
    vocab = llm.engine.loaded.arch.vocab_size
    rng = np.random.default_rng(batch + context)
    params = SamplingParams(temperature=0, max_tokens=10 * steps + 16, ignore_eos=True)
    for i in range(batch):
        core.add_request(Request(f"s{batch}-{context}-{i}", rng.integers(100, vocab, context).tolist(), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    served = model.native_steps
    for i in range(2 * steps):
        native = i % 2 == 0
        model.native_layers = native
        core.step()
        assert core.meter.last_step.num_scheduled_tokens == batch
        times[native].append(core.meter.last_step.total_s)
    model.native_layers = True
    assert model.native_steps - served == steps, "the stack did not serve every step it was given"
    core.abort(list(core.scheduler.requests))
    while core.has_unfinished():
        core.step()
    return {"native_ms": statistics.median(times[True]) * 1e3, "python_ms": statistics.median(times[False]) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model name or GGUF file (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(batches),
              max_num_batched_tokens=8192, kv_cache_memory=6.0, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    if model.layer_stack() is None:
        raise SystemExit("the native layer stack is unavailable here (kernels disabled or not built)")
    dtype = model.norm.weight.dtype
    console.print("measuring the floors (streaming read, matmul rate) ...")
    bw = bandwidth()
    rate = matmul_rate(sorted({(m.out_features, m.in_features) for m in model_linears(llm)}), dtype)
    console.print(f"  read {bw / 1e9:.1f} GB/s, {dtype} matmul {rate / 1e9:.0f} GFLOP/s")
    rows = []
    methods = ", ".join(sorted({m.method.name for m in model_linears(llm)}))
    table = Table(title=f"decode steps ({dtype}, weights {methods})")
    for h in ("batch", "context", "roofline ms", "native ms", "of roofline", "python ms", "native speed-up"):
        table.add_column(h, justify="right")
    for context in contexts:
        for batch in batches:
            t0 = time.perf_counter()
            bw = bandwidth()
            nbytes, flops, floor_s = step_floor(llm, batch, context, bw, rate)
            r = alternate(llm, batch, context, args.steps)
            row = {"batch": batch, "context": context, "read_gb_s": bw / 1e9, "bytes": nbytes, "flops": flops,
                   "roofline_ms": floor_s * 1e3, **r, "of_roofline": r["native_ms"] / (floor_s * 1e3),
                   "speedup": r["python_ms"] / r["native_ms"]}
            rows.append(row)
            console.print(f"  batch {batch} context {context} (read {bw / 1e9:.1f} GB/s): "
                          f"native {r['native_ms']:.2f} ms "
                          f"({row['of_roofline']:.2f}x roofline), python {r['python_ms']:.2f} ms "
                          f"({time.perf_counter() - t0:.0f} s)")
            table.add_row(str(batch), str(context), f"{row['roofline_ms']:.2f}", f"{r['native_ms']:.2f}",
                          f"{row['of_roofline']:.2f}x", f"{r['python_ms']:.2f}", f"{row['speedup']:.2f}x")
    Console().print(table)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"dtype": str(dtype), "read_gb_s": bw / 1e9, "matmul_gflop_s": rate / 1e9,
                                        "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
