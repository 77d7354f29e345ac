"""What batch-invariant numerics cost (`--deterministic`, the default): the same engine timed with the
batch-invariant kernels and with the batch-dependent fast paths, alternately in one process (this
machine's speed drifts over minutes), and whether greedy output stays the same alone and batched.

    .venv/bin/python benchmarks/batch_invariance.py                  # the default model
    .venv/bin/python benchmarks/batch_invariance.py --shape 1b       # Llama-3.2-1B's shape, random weights

Workloads (greedy, --ignore-eos lengths):
  c1       one stream: a 128-token prompt, 128 tokens out: decode tok/s (1 / TPOT)
  c32      32 prompts of 256 tokens at once, 128 tokens out each: output tok/s of the whole batch
  prefill  one 2,048-token prompt, 1 token out: prompt tok/s (1 / TTFT)
Each is run --rounds times per mode; the median is reported, and the ratio invariant / fast.
Writes results.json and batch_invariance.png to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tandem import LLM
from tandem.ops import extension
from tandem.sampling_params import SamplingParams

console = Console(stderr=True)

SHAPES = {  # hidden, layers, heads, kv heads, MLP: Llama-3.2's
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
}


def random_llama(shape: str, out: Path) -> Path:
    """A random-weight Llama at a real shape, in bfloat16, with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.model.loader import load_tokenizer

    hidden, layers, heads, kv_heads, mlp = SHAPES[shape]
    tokenizer = load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      tie_word_embeddings=True, torch_dtype="bfloat16", rope_theta=500000.0,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = out / f"llama-{shape}-random"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=length).tolist() for _ in range(n)]


def set_mode(llm: LLM, invariant: bool) -> None:
    extension.set_batch_invariant(invariant)
    llm.engine.core.runner.deterministic = invariant


def timed(llm: LLM, batch: list[list[int]], out_len: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, logprobs=1)
    llm.generate([{"prompt_token_ids": [*p], "cache_salt": str(time.perf_counter())} for p in batch[:1]],
                 SamplingParams(max_tokens=1), use_tqdm=False)  # warm the shapes
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": str(time.perf_counter())} for p in batch], params,
                        use_tqdm=False)
    return time.perf_counter() - t, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["default", *SHAPES], default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch_invariance"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.shape == "default" else str(random_llama(args.shape, Path(tmp)))
        llm = LLM(model, kv_cache_memory=2, max_num_batched_tokens=2048)
        vocab = llm.engine.model_arch.vocab_size if hasattr(llm.engine, "model_arch") else 32000
        vocab = min(vocab, len(llm.get_tokenizer()))
        loads = {"c1": (prompts(1, 128, vocab, 1), 128), "c32": (prompts(32, 256, vocab, 2), 128),
                 "prefill": (prompts(1, 2048, vocab, 3), 1)}
        times: dict[str, dict[str, list[float]]] = {w: {"invariant": [], "fast": []} for w in loads}
        same: dict[str, bool] = {}
        for batch, out_len in loads.values():  # a first pass of each, untimed: the process's first runs are slow
            timed(llm, batch[:4], min(out_len, 16))
        for r in range(args.rounds):
            for name, (batch, out_len) in loads.items():
                for mode in (("invariant", "fast") if r % 2 == 0 else ("fast", "invariant")):
                    set_mode(llm, mode == "invariant")
                    seconds, outs = timed(llm, batch, out_len)
                    times[name][mode].append(seconds)
                    if name == "c32" and mode == "invariant" and "c32" not in same:
                        # The first four prompts again, one at a time: the same tokens and logprobs?
                        alone = [timed(llm, [p], out_len)[1][0] for p in batch[:4]]
                        same["c32"] = all(a.outputs[0].token_ids == b.outputs[0].token_ids and
                                          a.outputs[0].logprobs == b.outputs[0].logprobs
                                          for a, b in zip(alone, outs[:4], strict=True))
                console.print(f"round {r + 1}/{args.rounds}: {name} done")
        llm.close()
    rows = {}
    for name, (batch, out_len) in loads.items():
        tokens = len(batch) * (out_len if name != "prefill" else len(batch[0]))
        rate = {m: tokens / statistics.median(v) for m, v in times[name].items()}
        rows[name] = {"invariant_tok_s": rate["invariant"], "fast_tok_s": rate["fast"],
                      "ratio": rate["invariant"] / rate["fast"], "seconds": times[name]}
    table = Table(title=f"batch invariance, {args.shape} model ({platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads, {extension.extension_isa()})")
    for col in ("workload", "invariant tok/s", "fast tok/s", "invariant / fast"):
        table.add_column(col)
    for name, row in rows.items():
        table.add_row(name, f"{row['invariant_tok_s']:.1f}", f"{row['fast_tok_s']:.1f}", f"{row['ratio']:.3f}")
    console.print(table)
    console.print(f"greedy tokens and logprobs of 4 prompts alone = in the batch of 32 (invariant): {same.get('c32')}")
    (args.out / "results.json").write_text(json.dumps({"shape": args.shape, "isa": extension.extension_isa(),
                                                        "rows": rows, "identical_alone_vs_batched": same}, indent=2))
    plot(rows, args.out / "batch_invariance.png", args.shape)


def plot(rows: dict, path: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [rows[n]["fast_tok_s"] for n in names], 0.4, label="batch-dependent (--no-deterministic)")
    ax.bar(x + 0.2, [rows[n]["invariant_tok_s"] for n in names], 0.4, label="batch-invariant (default)")
    ax.set_xticks(x, [f"{n}\n{rows[n]['ratio']:.2f}x" for n in names])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"What batch invariance costs ({shape} model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
