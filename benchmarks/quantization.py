"""Weights as stored (GGUF Q4_1 / Q8_0, activations in float or int8) against the same file dequantized,
on this machine's roofline: the linear kernels, decode steps, prompt steps, and what the quantization
costs in accuracy.

    .venv/bin/python benchmarks/quantization.py                       # everything, ~12 min on 2 cores
    .venv/bin/python benchmarks/quantization.py --parts kernels,steps  # some of it
    .venv/bin/python benchmarks/quantization.py --dtype bfloat16       # the model's dtype (default float32)

Floors are measured here, in this run: the memory bandwidth (a streaming read of 1 GiB) and the
matmul rate in the model's dtype (F.linear at 1,024 rows of the model's shapes). A decode step's
roofline is the larger of its bytes (weights + every request's KV) at that bandwidth and its FLOPs at
that rate. Results go to benchmarks/results/quantization.json and docs/quantization.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from offline_throughput import decode_step_times
from rich.console import Console
from rich.table import Table

from tandem import LLM
from tandem.config import parse_dtype
from tandem.engine.kv_layout import engine_kv_layout
from tandem.engine.request import Request
from tandem.model.held_weights import weight_bytes
from tandem.model.linear import Linear
from tandem.model.quant import QuantizedWeight, reference_linear
from tandem.model.scoring import agreed_prefix, perplexity
from tandem.ops import extension
from tandem.sampling_params import SamplingParams

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent


def best(fn: Callable[[], object], reps: int = 5, min_s: float = 0.2) -> float:
    """Best of reps timings of fn, each repeated to at least min_s."""
    fn()
    t0 = time.perf_counter()
    fn()
    n = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return min(times)


def bandwidth() -> float:
    """Bytes per second of a native streaming read of 1 GiB (tandem::stream_read: wide loads, several
    accumulators per thread); a sum of float32 where the kernels are not built."""
    if extension.load_extension():
        buf = torch.ones(1 << 30, dtype=torch.uint8)
        return buf.numel() / best(lambda: torch.ops.tandem.stream_read(buf), reps=7, min_s=0.0)
    x = torch.ones(2**28)
    return x.numel() * 4 / best(lambda: x.sum(), reps=5, min_s=0.0)


def matmul_rate(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: int = 1024) -> float:
    """FLOP/s of F.linear in dtype at `rows` rows over the model's (out, in) shapes."""
    ws = [torch.randn(n, k, dtype=dtype) for n, k in shapes]
    xs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
    flops = sum(2 * rows * n * k for n, k in shapes)
    return flops / best(lambda: [F.linear(x, w) for x, w in zip(xs, ws, strict=True)], reps=3)


def model_linears(llm: LLM) -> list[Linear]:
    model = llm.engine.core.runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m is not model.embed_tokens.table]


def kernels(quantized: LLM, rows_list: list[int]) -> list[dict]:
    """Each distinct quantized layer shape, float32 x: both kernels (float and int8 activations), the
    float arithmetic as dequantize + float32 GEMM, and a dense float32 F.linear on the dequantized weight."""
    seen: dict[tuple, QuantizedWeight] = {}
    for m in model_linears(quantized):
        w = m.quantized_weight()
        seen.setdefault((w.fmt.name, w.out_features, w.in_features), w)
    out = []
    with torch.inference_mode():
        for (fmt, n, k), w in seen.items():
            dense = w.dequantize()
            for rows in rows_list:
                x = torch.randn(rows, k)
                t_kernel, t_q8 = (best(lambda x=x, w=w, op=op: op(x, w.data, w.fmt.ggml_type, w.in_features, None))
                                  for op in (torch.ops.tandem.gguf_linear, torch.ops.tandem.gguf_linear_q8))
                t_gemm = best(lambda x=x, w=w: reference_linear(x, w))
                t_dense = best(lambda x=x, dense=dense: F.linear(x, dense))
                out.append({"format": fmt, "out": n, "in": k, "rows": rows, "kernel_ms": t_kernel * 1e3,
                            "kernel_q8_ms": t_q8 * 1e3, "dequant_gemm_ms": t_gemm * 1e3,
                            "dense_fp32_ms": t_dense * 1e3, "kernel_gb_s": w.data.numel() / t_kernel / 1e9,
                            "kernel_gflop_s": 2 * rows * n * k / t_kernel / 1e9})
    return out


def step_flops_bytes(llm: LLM, batch: int, context: int) -> tuple[float, float]:
    """FLOPs and bytes a decode step of `batch` requests at `context` tokens reads: every weight once (the
    default model's lm_head is its embedding), each request's KV."""
    model = llm.engine.core.runner.model
    arch = model.cfg
    params = sum(m.in_features * m.out_features for m in model_linears(llm))
    attn = 4 * batch * context * arch.num_heads * arch.head_dim * arch.num_layers
    kv = batch * context * engine_kv_layout(llm.engine.config, arch).bytes_per_token(arch)
    return 2 * params * batch + attn, weight_bytes(model) + kv


def steps(llms: dict[str, LLM], batches: list[int], context: int, bw: float, rate: float) -> list[dict]:
    out = []
    for name, llm in llms.items():
        vocab = llm.get_tokenizer().vocab_size
        for b in batches:
            r = decode_step_times(llm, b, context, steps=8, vocab=vocab)
            flops, nbytes = step_flops_bytes(llm, b, context)
            floor_s = max(nbytes / bw, flops / rate)
            r.update(weights=name, context=context, bytes=nbytes, flops=flops, roofline_ms=floor_s * 1e3,
                     of_roofline=r["step_ms"] / (floor_s * 1e3))
            out.append(r)
            console.print(f"  {name} batch {b}: {r['step_ms']:.1f} ms, {r['of_roofline']:.2f}x its roofline")
    return out


def prompts(llms: dict[str, LLM], lengths: list[int], rate: float) -> list[dict]:
    """One prompt alone, in steps of the engine's token budget: its linear + attention FLOPs (and the one
    sampled row's lm_head) against the matmul rate."""
    out = []
    for name, llm in llms.items():
        core = llm.engine.core
        model = core.runner.model
        arch = model.cfg
        params = sum(m.in_features * m.out_features for m in model_linears(llm) if m is not model.lm_head)
        for n in lengths:
            times = []
            for rep in range(2):  # the prompt in chunks of the engine's token budget, then its one token
                ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(rep)).tolist()
                core.add_request(Request(f"p{n}-{rep}", ids, SamplingParams(temperature=0, max_tokens=1)))
                t0 = time.perf_counter()
                while core.scheduler.requests:
                    core.step()
                times.append(time.perf_counter() - t0)
            t = min(times)
            flops = 2 * params * n + 2 * n * n * arch.num_heads * arch.head_dim * arch.num_layers  # causal QK^T, PV
            out.append({"weights": name, "tokens": n, "step_s": t, "tokens_per_s": n / t,
                        "gflop_s": flops / t / 1e9, "of_matmul_rate": flops / t / rate})
            console.print(f"  {name} {n} tokens: {n / t:.0f} tok/s, {flops / t / rate:.2f} of the matmul rate")
    return out


def accuracy(llms: dict[str, LLM], passages: list[str]) -> dict:
    tok = llms["none"].get_tokenizer()
    ids = tok.encode(" ".join(passages))[:1024]
    ppl = {name: perplexity(llm.engine.core.runner.model, ids) for name, llm in llms.items()}
    prompts_ = [p[:200] for p in passages[:8]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {name: [o.outputs[0].token_ids for o in llm.generate(prompts_, params)] for name, llm in llms.items()}
    result: dict = {"tokens": len(ids), "perplexity": ppl, "greedy_tokens": 0, "perplexity_ratio": {},
                    "greedy_agreement": {}}
    for name in ("gguf", "gguf-q8"):
        agreed, total = agreed_prefix(outs[name], outs["none"])
        result["perplexity_ratio"][name] = ppl[name] / ppl["none"]
        result["greedy_agreement"][name] = agreed / total
        result["greedy_tokens"] = total
    return result


def kv_cache(llms: dict[str, LLM], batches: list[int], context: int, bw: float, rate: float,
             passages: list[str]) -> dict:
    """The int8 KV cache against the model's dtype, both on the weights as stored: decode steps at a
    long context (where the KV is most of the bytes), perplexity and greedy agreement."""
    steps_ = steps({k: llms[k] for k in ("gguf", "gguf+int8kv")}, batches, context, bw, rate)
    model = llms["gguf"].engine.core.runner.model
    ids = llms["gguf"].get_tokenizer().encode(" ".join(passages))[:1024]
    ppl = {kv: perplexity(model, ids, kv) for kv in ("auto", "int8")}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts_ = [p[:200] for p in passages[:8]]
    outs = {k: [o.outputs[0].token_ids for o in llms[k].generate(prompts_, params)] for k in ("gguf", "gguf+int8kv")}
    agreed, total = agreed_prefix(outs["gguf+int8kv"], outs["gguf"])
    return {"steps": steps_, "perplexity": ppl, "perplexity_ratio": ppl["int8"] / ppl["auto"],
            "greedy_agreement": agreed / total, "greedy_tokens": total}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = {"gguf": "Q4_1 as stored", "gguf-q8": "Q4_1 as stored, int8 activations",
              "none": f"dequantized {result['dtype']}"}
    for name, style in (("gguf", "o-"), ("gguf-q8", "^-"), ("none", "s-")):  # the context-256 steps
        rows = [r for r in result["steps"] if r["weights"] == name]
        if not rows:
            continue
        label = labels[name]
        line = ax.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], style, label=label)[0]
        ax.plot([r["batch"] for r in rows], [r["roofline_ms"] for r in rows], ":", color=line.get_color(),
                label=f"{label}: roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (context 256)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"Decode steps vs roofline ({result['bandwidth_gb_s']:.0f} GB/s, "
                 f"{result['matmul_gflop_s']:.0f} GFLOP/s {result['dtype']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="kernels,steps,prompts,accuracy,kv")
    ap.add_argument("--kernel-rows", default="1,2,4,8,16,32,48,64,128")
    ap.add_argument("--step-batches", default="1,8,32,64,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--prompt-lengths", default="512,1024,2048,4096")
    ap.add_argument("--kv-batches", default="1,16,32")  # 32 x 1k tokens of float32 KV: 1.5 of the 2 GiB
    ap.add_argument("--kv-context", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    ap.add_argument("--plot", default="docs/quantization.png")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    dtype = parse_dtype(args.dtype)
    llms = {q: LLM(dtype=dtype, quantization=q, kv_cache_memory=2.0, max_num_seqs=256,
                   max_model_len=max(ints(args.prompt_lengths)) + 16)
            for q in ("gguf", "gguf-q8", "none")}
    by_weights = dict(llms)  # the weight formats' comparison, all with KV in the model's dtype
    if "kv" in parts:
        llms["gguf+int8kv"] = LLM(dtype=dtype, quantization="gguf", kv_cache_dtype="int8", kv_cache_memory=2.0,
                                  max_num_seqs=256, max_model_len=max(ints(args.prompt_lengths)) + 16)
    # The decoder layers' shapes: the lm_head at 1,024 rows would time a 200 MB output's page faults.
    head = llms["none"].engine.core.runner.model.lm_head
    shapes = sorted({(m.out_features, m.in_features) for m in model_linears(llms["none"]) if m is not head})
    result: dict = {"threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
                    "bandwidth_gb_s": bandwidth() / 1e9, "matmul_gflop_s": matmul_rate(shapes, dtype) / 1e9,
                    "weight_mib": {q: weight_bytes(llm.engine.core.runner.model) / 2**20 for q, llm in llms.items()}}
    console.print(f"floors: {result['bandwidth_gb_s']:.1f} GB/s, {result['matmul_gflop_s']:.0f} GFLOP/s {dtype}; "
                  f"weights {result['weight_mib']}")
    if "kernels" in parts:
        result["kernels"] = kernels(llms["gguf"], ints(args.kernel_rows))
        t = Table("format", "out x in", "rows", "kernel ms", "int8-act kernel ms", "GEMM ms", "dense ms",
                  "kernel GB/s")
        for r in result["kernels"]:
            t.add_row(r["format"], f"{r['out']}x{r['in']}", str(r["rows"]), f"{r['kernel_ms']:.3f}",
                      f"{r['kernel_q8_ms']:.3f}", f"{r['dequant_gemm_ms']:.3f}", f"{r['dense_fp32_ms']:.3f}",
                      f"{r['kernel_gb_s']:.1f}")
        console.print(t)
    if "steps" in parts:
        result["steps"] = steps(by_weights, ints(args.step_batches), args.context, result["bandwidth_gb_s"] * 1e9,
                                result["matmul_gflop_s"] * 1e9)
    if "prompts" in parts:
        result["prompts"] = prompts(by_weights, ints(args.prompt_lengths), result["matmul_gflop_s"] * 1e9)
    passages = [p for p in (ROOT / "tests/data/passages.txt").read_text().splitlines() if p.strip()]
    if "accuracy" in parts:
        result["accuracy"] = accuracy(by_weights, passages)
        console.print(result["accuracy"])
    if "kv" in parts:
        result["kv"] = kv_cache(llms, ints(args.kv_batches), args.kv_context, result["bandwidth_gb_s"] * 1e9,
                                result["matmul_gflop_s"] * 1e9, passages)
        console.print({k: v for k, v in result["kv"].items() if k != "steps"})
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if "steps" in result:
        plot(result, ROOT / args.plot)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
