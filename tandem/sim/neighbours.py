"""`tandem profile`'s co-location term: this engine's prefill and decode steps timed alone and beside
a neighbour, another engine process on the host's other cores running prefills, then decodes, as
the other worker of a one-machine deployment does (colocation.py holds what is measured).

    python -m tandem.sim.neighbour --kind prefill|decode --cores 1 [engine flags]

is the neighbour: it loads the same model, warms up, prints "ready", and runs its kind of step until
its parent goes away or it is told to stop.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import numpy as np

from tandem.engine.core import EngineCore
from tandem.sim.colocation import KINDS, Neighbours, step_kind
from tandem.sim.drive import run_prompts

PREFILL_TOKENS = 512  # a neighbour's prompts, and the profiled prefill's
DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 8, 256, 24
NEIGHBOUR_DECODE_STEPS = 2000  # a decode neighbour's batch: its prompts' prefill is 1 step in 2,000
READY_TIMEOUT_S = 300.0


def other_cores() -> list[int]:
    """The host's cores this process is not pinned to: where a neighbour goes."""
    own = os.sched_getaffinity(0)
    return [c for c in range(os.cpu_count() or 1) if c not in own]


def run_steps(core: EngineCore, kind: str, rng: np.random.Generator, vocab: int, tag: str,
              decode_steps: int = DECODE_STEPS) -> list[float]:
    """Seconds of each step of one scenario of this kind: a prompt alone, or a decode batch's steps
    (its prompts' steps left out)."""
    n, length = (1, PREFILL_TOKENS) if kind == "prefill" else (DECODE_BATCH, DECODE_CONTEXT)
    prompts = [rng.integers(1, vocab, length).tolist() for _ in range(n)]
    log = run_prompts(core, prompts, 1 if kind == "prefill" else decode_steps, f"neighbours-{tag}")
    return [s.seconds for s in log
            if step_kind(sum(x[1] for x in s.scheduled), sum(x[1] == 1 for x in s.scheduled)) == kind]


def median_step(core: EngineCore, kind: str, rng: np.random.Generator, vocab: int, tag: str, repeats: int) -> float:
    seconds = [t for r in range(repeats) for t in run_steps(core, kind, rng, vocab, f"{tag}-{r}")]
    return statistics.median(seconds)


def start_neighbour(kind: str, cores: list[int], engine_argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tandem.sim.neighbour", "--kind", kind, "--cores",
                             ",".join(map(str, cores)), *engine_argv],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it is warm, or dies
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {kind} neighbour did not start (exit {proc.poll()})")
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_neighbours(core: EngineCore, engine_argv: list[str], vocab: int, progress: Callable[[str], None],
                       repeats: int = 3, seed: int = 1) -> Neighbours | None:
    """slowdown[own][theirs] = (median step beside a `theirs` neighbour) / (median alone) - 1, alone
    timed before and after (the mean of the two: a shared machine drifts). None when this process
    holds every core (no neighbour can run beside it without taking its cores)."""
    cores = other_cores()
    if not cores:
        return None
    rng = np.random.default_rng(seed)
    before = {own: median_step(core, own, rng, vocab, "alone", repeats) for own in KINDS}
    beside: dict[str, dict[str, float]] = {}
    for theirs in KINDS:
        progress(f"co-location: a {theirs} neighbour on cores {','.join(map(str, cores))}")
        proc = start_neighbour(theirs, cores, engine_argv)
        try:
            for own in KINDS:
                beside.setdefault(own, {})[theirs] = median_step(core, own, rng, vocab, f"beside-{theirs}", repeats)
        finally:
            stop(proc)
    after = {own: median_step(core, own, rng, vocab, "alone-after", repeats) for own in KINDS}
    alone = {own: (before[own] + after[own]) / 2 for own in KINDS}
    slowdown = {own: {t: max(beside[own][t] / alone[own] - 1.0, 0.0) for t in KINDS} for own in KINDS}
    return Neighbours(slowdown, {"alone_s": alone, "alone_before_s": before, "alone_after_s": after,
                                 "beside_s": beside, "neighbour_cores": cores, "prefill_tokens": PREFILL_TOKENS,
                                 "decode_batch": DECODE_BATCH, "decode_context": DECODE_CONTEXT})
