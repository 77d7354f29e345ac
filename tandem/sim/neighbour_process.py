"""The neighbour process `tandem profile` times its steps beside (colocation_profile.py): the same engine on the
host's other cores, running prefills or decode batches without end. A kind written to its stdin (a line,
"prefill" or "decode") switches it, after a warm-up of that kind and another "ready": one process, and one
model load, serves both neighbours. It runs the kinds in KINDS order, prefill first: a decode neighbour's
batch is long, so a switch away from decode would wait for it."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys

import numpy as np

from tandem.process_exit import exit_now


def main(argv: list[str] | None = None) -> int:
    from tandem.config import EngineConfig
    from tandem.disagg.fleet.local_launcher import parse_cores
    from tandem.engine.args import add_engine_args, engine_kwargs
    from tandem.engine.core import EngineCore
    from tandem.engine.worker_group import load_engine_model
    from tandem.sim.colocation_profile import NEIGHBOUR_DECODE_STEPS, Scenario, run_steps

    p = argparse.ArgumentParser(prog="python -m tandem.sim.neighbour_process")
    add_engine_args(p)
    p.add_argument("--kind", required=True, choices=["prefill", "decode"])
    p.add_argument("--cores", required=True)
    p.add_argument("--prefill-tokens", type=int, default=Scenario.prefill_tokens)
    p.add_argument("--decode-batch", type=int, default=Scenario.decode_batch)
    p.add_argument("--decode-context", type=int, default=Scenario.decode_context)
    args = p.parse_args(argv)
    scenario = Scenario(args.prefill_tokens, args.decode_batch, args.decode_context)
    os.sched_setaffinity(0, parse_cores(args.cores))
    # Told to stop between two of its steps: nothing to close, so no interpreter teardown (0.4 s) to wait for.
    signal.signal(signal.SIGTERM, lambda *_: exit_now(0))
    parent = os.getppid()
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    loaded = load_engine_model(config)
    core = EngineCore(config, loaded.model)
    rng = np.random.default_rng(0)
    vocab = loaded.arch.vocab_size
    kind, i = args.kind, 0
    while True:
        run_steps(core, kind, rng, vocab, f"warmup-{kind}", scenario, decode_steps=4)
        print("ready", flush=True)
        # A decode neighbour's batch runs long: its prompts' own prefill is rare next to its decode steps.
        steps = NEIGHBOUR_DECODE_STEPS if kind == "decode" else 1
        while os.getppid() == parent and not select.select([sys.stdin], [], [], 0)[0]:
            run_steps(core, kind, rng, vocab, str(i), scenario, decode_steps=steps)
            i += 1
        line = sys.stdin.readline().strip() if os.getppid() == parent else ""
        if line not in ("prefill", "decode"):  # the parent went away or closed its end
            return 0
        kind = line


if __name__ == "__main__":
    sys.exit(main())
