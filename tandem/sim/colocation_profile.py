"""`tandem profile`'s co-location term: this engine's prefill and decode steps timed alone and beside
a neighbour, another engine process on the host's other cores running prefills, then decodes, as
the other worker of a one-machine deployment does (colocation.py holds what is measured).

    python -m tandem.sim.neighbour_process --kind prefill|decode --cores 1 [engine flags]

is the neighbour: it loads the same model, warms up, prints "ready", and runs its kind of step until
its parent goes away or it is told to stop.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.engine.core import EngineCore
from tandem.sim.colocation import KINDS, Neighbours, step_kind
from tandem.sim.drive import run_prompts

NEIGHBOUR_DECODE_STEPS = 2000  # a decode neighbour's batch: its prompts' prefill is 1 step in 2,000
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Scenario:
    """The steps timed (and the neighbour's): a prompt alone, or a decode batch's steps."""

    prefill_tokens: int = 512
    decode_batch: int = 8
    decode_context: int = 256
    decode_steps: int = 24

    def argv(self) -> list[str]:
        return ["--prefill-tokens", str(self.prefill_tokens), "--decode-batch", str(self.decode_batch),
                "--decode-context", str(self.decode_context)]


def other_cores() -> list[int]:
    """The host's cores this process is not pinned to: where a neighbour goes."""
    own = os.sched_getaffinity(0)
    return [c for c in range(os.cpu_count() or 1) if c not in own]


def run_steps(core: EngineCore, kind: str, rng: np.random.Generator, vocab: int, tag: str, scenario: Scenario,
              decode_steps: int | None = None) -> list[float]:
    """Seconds of each step of one scenario of this kind: a prompt alone, or a decode batch's steps
    (its prompts' steps left out)."""
    n, length = (1, scenario.prefill_tokens) if kind == "prefill" else (scenario.decode_batch, scenario.decode_context)
    prompts = [rng.integers(1, vocab, length).tolist() for _ in range(n)]
    steps = 1 if kind == "prefill" else decode_steps or scenario.decode_steps
    log = run_prompts(core, prompts, steps, f"neighbours-{tag}")
    return [s.seconds for s in log
            if step_kind(sum(x[1] for x in s.scheduled), sum(x[1] == 1 for x in s.scheduled)) == kind]


def median_step(core: EngineCore, kind: str, rng: np.random.Generator, vocab: int, tag: str, repeats: int,
                scenario: Scenario) -> float:
    seconds = [t for r in range(repeats) for t in run_steps(core, kind, rng, vocab, f"{tag}-{r}", scenario)]
    return statistics.median(seconds)


def start_neighbour(kind: str, cores: list[int], engine_argv: list[str], scenario: Scenario) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tandem.sim.neighbour_process", "--kind", kind, "--cores",
                             ",".join(map(str, cores)), *scenario.argv(), *engine_argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    _wait_ready(proc, kind)
    return proc


def switch_neighbour(proc: subprocess.Popen[str], kind: str) -> None:
    """The same neighbour process, now running steps of this kind (neighbour_process.py)."""
    assert proc.stdin is not None
    proc.stdin.write(f"{kind}\n")
    proc.stdin.flush()
    _wait_ready(proc, kind)


def _wait_ready(proc: subprocess.Popen[str], kind: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it is warm, or dies
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {kind} neighbour did not start (exit {proc.poll()})")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_neighbours(core: EngineCore, engine_argv: list[str], vocab: int, progress: Callable[[str], None],
                       repeats: int = 3, seed: int = 1, scenario: Scenario = Scenario()) -> Neighbours | None:
    """slowdown[own][theirs] = (median step beside a `theirs` neighbour) / (median alone) - 1, alone
    timed before and after (the mean of the two: a shared machine drifts). None when this process
    holds every core (no neighbour can run beside it without taking its cores)."""
    cores = other_cores()
    if not cores:
        return None
    rng = np.random.default_rng(seed)
    before = {own: median_step(core, own, rng, vocab, "alone", repeats, scenario) for own in KINDS}
    beside: dict[str, dict[str, float]] = {}
    proc = None
    try:
        for theirs in KINDS:  # prefill first: neighbour_process.py switches away from a decode batch only at its end
            progress(f"co-location: a {theirs} neighbour on cores {','.join(map(str, cores))}")
            if proc is None:
                proc = start_neighbour(theirs, cores, engine_argv, scenario)
            else:
                switch_neighbour(proc, theirs)
            for own in KINDS:
                beside.setdefault(own, {})[theirs] = median_step(core, own, rng, vocab, f"beside-{theirs}", repeats,
                                                                 scenario)
    finally:
        if proc is not None:
            stop(proc)
    after = {own: median_step(core, own, rng, vocab, "alone-after", repeats, scenario) for own in KINDS}
    alone = {own: (before[own] + after[own]) / 2 for own in KINDS}
    slowdown = {own: {t: max(beside[own][t] / alone[own] - 1.0, 0.0) for t in KINDS} for own in KINDS}
    return Neighbours(slowdown, {"alone_s": alone, "alone_before_s": before, "alone_after_s": after,
                                 "beside_s": beside, "neighbour_cores": cores,
                                 "prefill_tokens": scenario.prefill_tokens, "decode_batch": scenario.decode_batch,
                                 "decode_context": scenario.decode_context})
