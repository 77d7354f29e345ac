"""Which path a request takes through the cluster, chosen per request against the SLOs.

The paths (each over the workers the routing policy picked in its pool):
  colocated      the whole request on one worker: a colocated worker, or a decode worker that
                 prefills the prompt itself (no transfer: TaiChi's and Dynamo's conditional
                 disaggregation for short prompts on lightly loaded decode workers);
  disaggregated  a prefill-capable worker (prefill or colocated) computes the prompt and ships its
                 KV to a decode worker, which streams the rest;
  prefill-free   the KV store holds the prompt: a decode worker loads it and computes only its tail.

For each, from the workers' measured speeds (latency.py) and the request's length:
  TTFT = (prompt tokens queued there + the prompt's tokens past its cached overlap) / prefill rate
         + the transfer time that showed on a prefill's critical path (disaggregated; prefill-free:
         one decode step for the load);
  TPOT = the decode worker's step time (none for a one-token request); and, when the worker that
         computes the prompt is decoding others (a colocated or decode worker), the stall its prefill
         puts on them, spread over as many tokens as this request's output (the workload's lengths
         standing in for theirs): the cost of mixing, borne by its neighbours, so scored with the TPOT
         but not part of the request's own prediction.
Each path's predictions carry a learned bias: what its finished requests measured beyond what was
predicted (router and messaging time, contention the speeds do not show), smoothed (dispatch.py).
The path whose worse ratio to its SLO, max(TTFT / SLO, TPOT / SLO), is lowest wins: it meets both
with the most headroom, or misses by the least; a path without a transfer wins unless a transfer
gains at least a tenth of an SLO. Policy `disaggregated` skips the prediction: every
prompt goes through a prefill/decode pair when there is one (the store's prefill-free path first).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.policy.latency import Speed
from tandem.slo import Slo

PATH_POLICIES = ("slo", "disaggregated")
ASSUMED_OUTPUT_TOKENS = 256  # a request without max_tokens: how far its prefill's stall is spread
TRANSFER_MARGIN = 0.1  # of an SLO: the headroom a transfer must gain over running on one worker


@dataclass
class PathOption:
    path: str  # colocated | disaggregated | prefill-free
    prefill: object | None  # the worker that computes the prompt when another decodes (WorkerHandle)
    decode: object  # the worker that streams the tokens (WorkerHandle)
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    stall_s: float = 0.0  # added to the TPOT of the decodes that share the worker computing its prompt
    overlap_blocks: int = 0  # of the prompt's full blocks, those cached where it is computed

    def score(self, slo: Slo) -> float:
        return max(self.ttft_s / slo.ttft_s, (self.tpot_s + self.stall_s) / slo.tpot_s)


def stall(speed: Speed, prompt_left: int, max_tokens: int | None) -> float:
    """What computing this prompt on the worker adds to the TPOT of the requests decoding there."""
    if not speed.decoding:
        return 0.0
    spread = max(1, min(max_tokens or ASSUMED_OUTPUT_TOKENS, ASSUMED_OUTPUT_TOKENS))
    return prompt_left / speed.prefill_tok_s / spread


def own_tpot(speed: Speed, max_tokens: int | None) -> float:
    return 0.0 if max_tokens == 1 else speed.step_s


def predict_local(speed: Speed, prompt_left: int, max_tokens: int | None) -> tuple[float, float, float]:
    """(TTFT, TPOT, stall) of the request computed and decoded on one worker."""
    ttft = (speed.queued_prompt_tokens + prompt_left) / speed.prefill_tok_s
    return ttft, own_tpot(speed, max_tokens), stall(speed, prompt_left, max_tokens)


def predict_disaggregated(prefill: Speed, decode: Speed, prompt_left: int, max_tokens: int | None
                          ) -> tuple[float, float, float]:
    """(TTFT, TPOT, stall): the prompt on one worker, the rest on another."""
    ttft = (prefill.queued_prompt_tokens + prompt_left) / prefill.prefill_tok_s + prefill.exposed_transfer_s
    return ttft, own_tpot(decode, max_tokens), stall(prefill, prompt_left, max_tokens)


def predict_prefill_free(decode: Speed, tail_tokens: int) -> tuple[float, float]:
    return (decode.queued_prompt_tokens + tail_tokens) / decode.prefill_tok_s + decode.step_s, decode.step_s


def choose(options: list[PathOption], slo: Slo) -> PathOption:
    """The option with the most headroom, unless one without a transfer comes within TRANSFER_MARGIN
    of it: a transfer also costs a prefill worker's compute and the wire, which the request's own
    latency does not show. On a tie the earlier option."""
    best = min(options, key=lambda o: o.score(slo))
    local = [o for o in options if o.prefill is None]
    if local:
        nearest = min(local, key=lambda o: o.score(slo))
        if nearest.score(slo) <= best.score(slo) + TRANSFER_MARGIN:
            return nearest
    return best
