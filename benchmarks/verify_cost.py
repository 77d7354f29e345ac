"""What verifying k speculative drafts costs at one stream, against a one-token decode step: one
request with `--contexts` tokens cached computes its newest token plus k drafts (k + 1 rows, a
logits row for each, as speculative decoding's verification does), timed on the engine's runner
with its own kernels and sampler.

    .venv/bin/python benchmarks/verify_cost.py                       # k 0-16, context 256 and 1,024
    .venv/bin/python benchmarks/verify_cost.py --drafts 0,4,8 --contexts 256 --rounds 20

Each round times every k once, in turn (this machine's speed drifts over minutes); the medians are
reported with the ratio to k = 0. Goal (issue #32): k <= 8 at most 1.3x a one-token step.
Results: benchmarks/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tandem import LLM
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.step import ScheduledRequest, SchedulerOutput
from tandem.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "verify_cost.json"


def verify_step(runner: ModelRunner, context: int, drafts: int, vocab: int) -> float:
    """Seconds for one step: a request at `context` cached tokens verifying `drafts` drafts."""
    tokens = [(7 * i + 3) % vocab for i in range(context + 1)]
    request = Request("verify-cost", tokens, SamplingParams(temperature=0.0, max_tokens=drafts + 2))
    request.num_computed_tokens = context
    request.spec_token_ids = [(11 * i + 5) % vocab for i in range(drafts)]
    n = drafts + 1
    blocks = list(range(-(-(context + n) // runner.block_size)))
    t0 = time.perf_counter()
    out = runner.execute(SchedulerOutput([ScheduledRequest(request, n, blocks)]))
    seconds = time.perf_counter() - t0
    assert 1 <= len(out.sampled["verify-cost"]) <= n
    runner.forget(["verify-cost"])
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafts", default="0,1,2,3,4,5,6,7,8,12,16")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    drafts = [int(k) for k in args.drafts.split(",")]
    if 0 not in drafts:
        drafts = [0, *drafts]
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=0.5, enable_prefix_caching=False)
    runner, vocab = llm.engine.core.runner, llm.engine.loaded.arch.vocab_size
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        times: dict[int, list[float]] = {k: [] for k in drafts}
        for k in drafts:  # warm-up: first passes create kernels and touch pages
            verify_step(runner, context, k, vocab)
        for _ in range(args.rounds):
            for k in drafts:
                times[k].append(verify_step(runner, context, k, vocab))
        base = statistics.median(times[0])
        print(f"context {context}: one-token step {base * 1e3:.2f} ms")
        print(f"{'drafts':>6} {'ms':>8} {'x step':>7}")
        for k in drafts:
            med = statistics.median(times[k])
            rows.append({"context": context, "drafts": k, "ms": med * 1e3, "ratio": med / base})
            print(f"{k:>6} {med * 1e3:>8.2f} {med / base:>7.2f}", flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"model": llm.engine.loaded.name, "dtype": args.dtype, "rows": rows,
                                        "goal_ratio_k_le_8": 1.3}, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
