"""Offline throughput: Tandem vs Hugging Face transformers static batching, and the decode step
split into model forward and everything else.

    .venv/bin/python benchmarks/offline_throughput.py                  # the full run (issue #2)
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 32 --skip-hf   # a quick look

Both engines use the same weights (the default GGUF model), dtype and thread count, in one run.
Results go to benchmarks/results/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tandem import LLM, SamplingParams
from tandem.engine.request import Request

console = Console(stderr=True)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Avoid the lowest ids, which are special tokens in most vocabularies.
    return [rng.integers(100, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def run_tandem(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_throughput": n_out / elapsed,
            "total_throughput": (n_in + n_out) / elapsed}


def combine(runs: list[dict]) -> dict:
    """Several runs of the same workload as one: tokens and seconds summed."""
    elapsed = sum(r["elapsed_s"] for r in runs)
    out_tokens = sum(r["output_tokens"] for r in runs)
    total = sum(r["total_throughput"] * r["elapsed_s"] for r in runs)
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_throughput": out_tokens / elapsed,
            "total_throughput": total / elapsed, "runs": len(runs)}


def dense_hf_model(model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Llama with the same dequantized weights as Tandem, dense, in the same dtype.

    (transformers' own GGUF loading keeps the weights packed and casts on every matmul, which
    would measure its GGUF kernels rather than static batching.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.model.loader import load_gguf_weights

    arch, weights = load_gguf_weights(model_path)
    cfg = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                      intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                      num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                      head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                      max_position_embeddings=arch.max_position_embeddings,
                      tie_word_embeddings=arch.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.to(dtype) for k, v in weights.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if arch.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # computed buffers were on meta
    return model.to(dtype).eval()


def run_hf(model_path: Path, dtype: torch.dtype, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    model = dense_hf_model(model_path, dtype)
    start = time.perf_counter()
    n_out = 0
    with Progress(console=console, transient=True) as progress, torch.inference_mode():
        task = progress.add_task("transformers static batches", total=len(prompts))
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(chunk):  # left padding, as generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=0)
            n_out += (out.shape[1] - width) * len(chunk)
            progress.advance(task, len(chunk))
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_throughput": n_out / elapsed,
            "total_throughput": (n_in + n_out) / elapsed, "batch_size": batch}


def decode_step_times(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """Fill the engine with `batch` requests, then time pure decode steps."""
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # outlives the measurement
    rng = np.random.default_rng(batch)
    for i in range(batch):
        core.add_request(Request(f"step-{batch}-{i}", rng.integers(100, vocab, prompt_len).tolist(), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    fwd, other = [], []
    for _ in range(steps):
        core.step()
        s = core.meter.last_step
        assert s.num_scheduled_tokens == batch, f"expected a pure decode step, got {s.num_scheduled_tokens} tokens"
        fwd.append(s.runner.forward_s)
        other.append(s.total_s - s.runner.forward_s)
    core.abort(list(core.scheduler.requests))
    f, o = statistics.median(fwd), statistics.median(other)
    return {"batch": batch, "step_ms": (f + o) * 1e3, "forward_ms": f * 1e3, "other_ms": o * 1e3,
            "other_pct": 100 * o / (f + o), "tokens_per_s": batch / (f + o)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)  # 64 measured ~2% above 32, 16 ~15% below
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--step-batches", default="1,8,32,64,128")
    ap.add_argument("--step-prompt-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate Tandem and transformers this many times (this machine's speed drifts by "
                         "tens of percent over minutes; alternating spreads the drift over both)")
    ap.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()

    threads = args.threads or torch.get_num_threads()
    llm = LLM(args.model, dtype=args.dtype, num_threads=threads, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    torch.set_num_threads(threads)
    vocab = llm.engine.loaded.arch.vocab_size
    result: dict = {"config": vars(args) | {"threads": threads}}

    console.print(f"[bold]Tandem[/]: {args.num_prompts} prompts, {args.min_input}-{args.max_input} in, "
                  f"{args.output_len} out, {args.dtype}, {threads} threads")
    rounds: list[dict] = []
    for r in range(args.rounds):
        # Fresh prompts each round (both engines get the same ones): a repeat would hit the prefix cache.
        prompts = random_prompts(args.num_prompts, args.min_input, args.max_input, vocab, seed=r)
        entry = {"tandem": run_tandem(llm, prompts, args.output_len)}
        if not args.skip_hf:
            console.print(f"[bold]transformers[/] static batching on the same weights (round {r + 1}/{args.rounds})")
            entry["transformers"] = run_hf(llm.engine.loaded.path, llm.engine.config.model.torch_dtype, prompts,
                                           args.output_len, args.hf_batch_size)
            entry["speedup_output_throughput"] = (entry["tandem"]["output_throughput"]
                                                  / entry["transformers"]["output_throughput"])
        rounds.append(entry)
    result["rounds"] = rounds
    for name in ("tandem", "transformers"):
        if name in rounds[0]:
            result[name] = combine([e[name] for e in rounds])
    if "transformers" in result:
        result["speedup_output_throughput"] = (result["tandem"]["output_throughput"]
                                               / result["transformers"]["output_throughput"])
    steps = [decode_step_times(llm, int(b), args.step_prompt_len, 12, vocab) for b in args.step_batches.split(",")]
    result["decode_steps"] = steps

    table = Table(title="offline throughput")
    for col in ("engine", "elapsed s", "output tok/s", "total tok/s"):
        table.add_column(col, justify="right")
    for name in ("tandem", "transformers"):
        if name in result:
            r = result[name]
            table.add_row(name, f"{r['elapsed_s']:.1f}", f"{r['output_throughput']:.1f}",
                          f"{r['total_throughput']:.1f}")
    Console().print(table)
    if "speedup_output_throughput" in result:
        per_round = ", ".join(f"{e['speedup_output_throughput']:.2f}x" for e in rounds)
        print(f"tandem / transformers output tok/s: {result['speedup_output_throughput']:.2f}x "
              f"(rounds: {per_round})")
    steps_table = Table(title=f"decode step (context {args.step_prompt_len})")
    for col in ("batch", "step ms", "forward ms", "other ms", "other %", "tok/s"):
        steps_table.add_column(col, justify="right")
    for s in steps:
        steps_table.add_row(str(s["batch"]), f"{s['step_ms']:.1f}", f"{s['forward_ms']:.1f}",
                            f"{s['other_ms']:.2f}", f"{s['other_pct']:.1f}", f"{s['tokens_per_s']:.0f}")
    Console().print(steps_table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot_steps(steps, out.with_suffix(".png"))
    return 0


def plot_steps(steps: list[dict], path: Path) -> None:
    """Stacked bars: model forward vs everything else, per decode batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(s["batch"]) for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [s["forward_ms"] for s in steps], label="model forward")
    ax.bar(labels, [s["other_ms"] for s in steps], bottom=[s["forward_ms"] for s in steps],
           label="schedule + prepare + sample + update")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per step")
    ax.set_title("Tandem decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    console.print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
