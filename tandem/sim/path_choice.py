"""The router's per-request path choice, simulated: the same predictions and rule (policy/paths.py),
fed with what a simulated instance's cost model and scheduler say instead of a live worker's reports.

Where the live router learns a prefill rate and a decode step from a worker's stats, the simulator
prices them: the prompt's own prefill (up to one step's token budget) on that instance, and a decode
step of its present batch with one more stream. Its prompt queue and decode count are the
scheduler's own; the exposed transfer is the last layer's share of the prompt's KV behind what the
instance's link is still sending. The learned per-path bias is not simulated (it corrects for what
the live predictions miss, which the simulation does not).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.policy.latency import Speed
from tandem.policy.paths import PathOption, choose, predict_disaggregated, predict_local
from tandem.sim.cost import StepShape
from tandem.sim.instance import SimInstance
from tandem.slo import Slo


def sim_speed(worker: SimInstance, prompt_len: int, link_backlog_s: float = 0.0) -> Speed:
    cost, sched = worker.cost, worker.scheduler
    chunk = max(1, min(prompt_len, worker.scheduler_config.max_num_batched_tokens))
    prefill_s = cost.step_time(StepShape.of([(chunk, 0, True)]))
    decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens <= 1]
    context = sum(r.num_computed_tokens for r in decoding) / len(decoding) if decoding else prompt_len
    step_s = cost.step_time(StepShape.of([(1, int(context), True)] * (len(decoding) + 1)))
    nbytes = prompt_len * cost.kv_bytes_per_token
    exposed = link_backlog_s + cost.transfer_time(nbytes / max(cost.num_layers, 1))
    return Speed(chunk / prefill_s, step_s, exposed, sched.num_waiting_prompt_tokens(), sched.num_decoding())


def choose_path(prompt_len: int, max_tokens: int, whole: list[SimInstance], prefill: SimInstance | None,
                decode: SimInstance | None, slo: Slo, backlog: Callable[[SimInstance], float]) -> PathOption:
    """The router's choice between running the request whole on one of `whole` (a colocated or a
    decode instance) and the pair `prefill` -> `decode`."""
    options = []
    for w in whole:
        ttft, tpot, stall = predict_local(sim_speed(w, prompt_len), prompt_len, max_tokens)
        options.append(PathOption("colocated", None, w, ttft, tpot, stall))
    if prefill is not None and decode is not None and prefill is not decode:
        ttft, tpot, stall = predict_disaggregated(sim_speed(prefill, prompt_len, backlog(prefill)),
                                                  sim_speed(decode, prompt_len), prompt_len, max_tokens)
        options.append(PathOption("disaggregated", prefill, decode, ttft, tpot, stall))
    if not options:
        raise ValueError("no instance of the deployment can serve this request yet")
    return choose(options, slo)
