"""Driving a live engine core through a scenario for `tandem profile`: the steps it logged."""

from __future__ import annotations

from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.engine.step_meter import LoggedStep
from tandem.sampling_params import SamplingParams


def run_prompts(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> list[LoggedStep]:
    """Run the prompts to completion on the core (greedy, EOS ignored); the steps it logged."""
    log: list[LoggedStep] = []
    core.meter.step_log = log
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"profile-{tag}-{i}", p, params))
    while core.has_unfinished():
        core.step()
    core.meter.step_log = None
    return log
