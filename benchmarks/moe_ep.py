"""Expert parallelism on this machine: a random Qwen3-MoE model's decode step with its experts in one
process (2 threads) against two single-threaded ranks holding half the experts each
(--expert-parallel-size 2, attention whole on both), on a skewed router (experts 0-3 take most rows:
rank 0's), with EPLB off and on.

    .venv/bin/python benchmarks/moe_ep.py                 # batch 16 and 64, 2 rounds
    .venv/bin/python benchmarks/moe_ep.py --batches 16 --rounds 1

Each configuration runs in its own process, in turn per round. Reported per configuration and batch:
the decode step's median, and (expert parallel) max / mean rows per rank over the last load window of
each sparse layer (EPLB's goal: at most 1.3), and the seconds rank 0 spent in all-to-alls and
all-gathers. The model: hidden 512, 8 layers, 16 experts (top 2) of intermediate 768, vocabulary 4,096,
float32; built once into benchmarks/results/moe_model/.
Results: benchmarks/results/moe_ep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "moe_ep.json"
MODEL = RESULTS.parent / "moe_model"
CONFIGS = {"ep1": dict(expert_parallel_size=1), "ep2": dict(expert_parallel_size=2, eplb_interval=8),
           "ep2-eplb": dict(expert_parallel_size=2, enable_eplb=True, eplb_spare_slots=4, eplb_interval=8)}


def build_model(path: Path) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=2048, tie_word_embeddings=False, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.05)
            if name.endswith("mlp.gate.weight"):  # skew: the first quarter of the experts are hot
                p[4:] *= 0.05
                p[:4] *= 3.0
    model.save_pretrained(path, safe_serialization=True)


def run_one(name: str, batches: list[int], steps: int, prompt_len: int) -> dict:
    import numpy as np

    from tandem import LLM, SamplingParams

    llm = LLM(str(MODEL), dtype="float32", kv_cache_memory=0.5, enable_prefix_caching=False,
              max_num_seqs=max(batches), **CONFIGS[name])
    core = llm.engine.core
    rng = np.random.default_rng(0)
    out: dict = {"step_s": {}, "imbalance": {}, "comm_s": {}}
    for b in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(b):
            llm.engine.add_request(f"{b}-{i}", rng.integers(0, 4096, prompt_len).tolist(), params)
        times, comm_before = [], None
        while llm.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            llm.engine.step()
            seconds = time.perf_counter() - t0
            if core.meter.last_step.num_scheduled_tokens == b:  # every request decoding
                times.append(seconds)
                if comm_before is None and core.runner.comm is not None:
                    comm_before = dict(core.runner.comm.seconds)
        out["step_s"][b] = statistics.median(times[1:])
        loads = core.runner.model.expert_loads()
        out["imbalance"][b] = [round(load.imbalance, 3) for load in loads if load.per_rank]
        if core.runner.comm is not None and comm_before is not None:
            now = core.runner.comm.seconds
            out["comm_s"][b] = {k: (now[k] - comm_before.get(k, 0.0)) / len(times) for k in now}
    out["rebalances"] = sum(load.rebalances for load in core.runner.model.expert_loads())
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(run_one(args.one, batches, args.steps, args.prompt_len)))
        return
    if not (MODEL / "config.json").exists():
        print(f"building the model in {MODEL}", flush=True)
        build_model(MODEL)
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for name in args.configs.split(","):
            cmd = [sys.executable, __file__, "--one", name, "--batches", args.batches, "--steps", str(args.steps),
                   "--prompt-len", str(args.prompt_len)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if proc.returncode:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.setdefault(name, []).append(res)
            print(f"round {rnd + 1} {name}: " + ", ".join(
                f"b{b} {s * 1e3:.1f} ms (max/mean per layer {res['imbalance'].get(b, [])})"
                for b, s in res["step_s"].items()), flush=True)
    configs = {name: {"step_s": {b: statistics.median(r["step_s"][b] for r in rs) for b in rs[0]["step_s"]},
                      "imbalance_max": {b: max(max(r["imbalance"][b], default=1.0) for r in rs)
                                        for b in rs[0]["imbalance"]},
                      "comm_s": rs[-1]["comm_s"], "rebalances": rs[-1]["rebalances"]}
               for name, rs in runs.items()}
    print("\nbatch  " + "  ".join(f"{n:>22}" for n in configs))
    for b in map(str, batches):
        cells = []
        for c in configs.values():
            imb = c["imbalance_max"].get(b)
            cells.append(f"{c['step_s'][b] * 1e3:8.1f} ms" + (f" (<= {imb:.2f}x)" if imb else " " * 11))
        print(f"{b:>5}  " + "  ".join(f"{cell:>22}" for cell in cells))
    results = {"batches": batches, "configs": configs, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
