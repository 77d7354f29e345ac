"""What a decode step costs on the host, per scheduled request: the scheduler's schedule(), the runner's
batch packing (input ids, positions, slots, block tables: everything before the forward pass) and
update_from_output, measured on the engine as it runs (EngineCore.meter.last_step), excluding the model's
forward pass and the sampler.

    .venv/bin/python benchmarks/step_host_cost.py                      # batches 1, 32, 128 at context ~256
    .venv/bin/python benchmarks/step_host_cost.py --batches 128 --prompt-len 1024

Every request has a prompt of --prompt-len random tokens and decodes --steps steps (ignore_eos); the
prompts are computed first, then the decode steps are timed. Goal (issue #32): at most 5 us per
scheduled request at 128 running. Results: benchmarks/results/step_host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from tandem import LLM, SamplingParams
from tandem.engine.request import Request

RESULTS = Path(__file__).resolve().parent / "results" / "step_host_cost.json"


def measure(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> dict[str, float]:
    core = llm.engine.core
    vocab = llm.engine.loaded.arch.vocab_size
    rng = np.random.default_rng(seed)
    # Long enough that no stream ends while it is measured (the first prompts decode while later ones compute).
    params = SamplingParams(temperature=0, max_tokens=2048, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        core.add_request(Request(rid, rng.integers(0, vocab, prompt_len).tolist(), params))
    while any(core.scheduler.requests[r].num_computed_tokens < prompt_len for r in ids):
        core.step()  # the prompts
    parts: dict[str, list[float]] = {"schedule": [], "prepare": [], "update": [], "forward": [], "sample": []}
    for _ in range(steps):
        core.step()
        s = core.meter.last_step
        assert s.num_requests == batch, (s.num_requests, batch)
        for name, value in (("schedule", s.schedule_s), ("prepare", s.runner.prepare_s), ("update", s.update_s),
                            ("forward", s.runner.forward_s), ("sample", s.runner.sample_s)):
            parts[name].append(value)
    core.abort(ids)
    while core.has_unfinished():
        core.step()
    med = {name: statistics.median(v) for name, v in parts.items()}
    host = med["schedule"] + med["prepare"] + med["update"]
    return {"batch": batch, "prompt_len": prompt_len, **{f"{k}_us": v * 1e6 for k, v in med.items()},
            "host_us": host * 1e6, "host_us_per_request": host * 1e6 / batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(None, dtype="bfloat16", max_num_seqs=max(batches), max_num_batched_tokens=4096,
              kv_cache_memory=4.0, enable_prefix_caching=False)  # room for 128 x 1,024 tokens and more
    rows = []
    heads = ("batch", "schedule", "prepare", "update", "host/req", "forward")
    print(f"{heads[0]:>5}", *(f"{h:>10}" for h in heads[1:]), " (us, medians)")
    for batch in batches:
        t0 = time.perf_counter()
        row = measure(llm, batch, args.prompt_len, args.steps, args.seed)
        rows.append(row)
        print(f"{batch:>5} {row['schedule_us']:>10.0f} {row['prepare_us']:>10.0f} {row['update_us']:>10.0f} "
              f"{row['host_us_per_request']:>10.1f} {row['forward_us']:>10.0f}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"rows": rows, "goal_us_per_request_at_128": 5.0}, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
