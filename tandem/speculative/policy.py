"""When speculation pays: each step, the drafts that make the step's expected useful tokens per
second grow.

A step's time is overhead + f(tokens) + scale x (f(tokens + drafts) - f(tokens)): f measured on
this machine at start-up (profile.py); the overhead (attention over long contexts, Python,
sampling) learned from decode steps without drafts, and the drafts' cost scale from those with
them (a verifying request's queries leave the decode kernel for the multi-token attention path,
which the profile's short context does not show: measured 2-3x the profile at 16 streams). Draft j
of request i yields alpha_i^j tokens in expectation: each draft is accepted, given the ones before
it were, with probability alpha_i, estimated by the length of the match it rests on (over all
requests) and then by the request's own record. The policy takes drafts in order of expected yield
and keeps the prefix that maximises (n + P + yield) / (step time) for n streams
and P prompt tokens computed in the same step: prompt tokens are as useful as output tokens, and
where the step budget is full a draft takes a prompt token's place. At one stream, where a step
costs its weight bytes whatever its tokens, most drafts pay. Past the profile's knee (a step of
that many tokens costs twice a one-token step) every token costs FLOPs and speculation is off, and
then no proposer runs at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

# A draft's acceptance is estimated by how long a match it rests on (its bucket, over all requests),
# then by its request's own record. A bucket starts optimistic and its counts decay every step, so a
# bucket the policy stopped trying is tried again later (the workload may have changed).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # lower bounds
BUCKET_PRIOR, BUCKET_PRIOR_WEIGHT = 0.7, 2.0
BUCKET_DECAY = 0.999  # per step: counts halve in ~700 steps
REQUEST_PRIOR_WEIGHT = 4.0  # the bucket's estimate counts as this many of the request's own drafts
OVERHEAD_EWMA = 0.2
DRAFT_COST_SCALE_RANGE = (0.5, 10.0)
# A step is bound by its weight bytes while its tokens cost at most this many times one token's step
# (the profile's knee). Past the knee each token costs FLOPs, and speculation is off: measured here,
# the cost model alone let 16 and 64 streams lose 5-40% to drafts whose verification leaves the
# decode kernel (a per-request cost the token count does not show).
WEIGHT_BOUND_FACTOR = 2.0


@dataclass
class StepCost:
    """Seconds of a forward pass of n tokens: measured points, linear between and past the last."""

    tokens: np.ndarray
    seconds: np.ndarray

    def __call__(self, n: float) -> float:
        t, s = self.tokens, self.seconds
        if n <= t[-1] or len(t) < 2:
            return float(np.interp(n, t, s))
        slope = (s[-1] - s[-2]) / (t[-1] - t[-2])
        return float(s[-1] + slope * (n - t[-1]))


@dataclass
class _Counts:
    accepted: float = 0.0
    rejected: float = 0.0  # verifications that ended at a rejected draft

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


def _bucket(match_len: int) -> int:
    return int(np.searchsorted(MATCH_BUCKETS, match_len, side="right")) - 1 if match_len >= 1 else 0


@dataclass
class SpecPolicy:
    num_speculative_tokens: int
    cost: StepCost | None  # None: not adaptive, every proposed draft is verified
    overhead_s: float = 0.0
    draft_cost_scale: float = 1.0
    _buckets: list[_Counts] = field(default_factory=lambda: [_Counts() for _ in MATCH_BUCKETS])
    _requests: dict[str, _Counts] = field(default_factory=dict)

    @functools.cached_property
    def knee(self) -> int:
        """The fewest tokens whose step costs more than WEIGHT_BOUND_FACTOR x one token's."""
        assert self.cost is not None
        over = self.cost.tokens[self.cost.seconds > WEIGHT_BOUND_FACTOR * self.cost(1)]
        return int(over[0]) if len(over) else 1 << 30

    def acceptance(self, request_id: str, match_len: int | None) -> float:
        """Estimated chance that a draft of this request, resting on a match of match_len tokens, is
        accepted given the drafts before it were (None: the best any bucket offers)."""
        rates = [b.rate(BUCKET_PRIOR, BUCKET_PRIOR_WEIGHT) for b in self._buckets]
        prior = max(rates) if match_len is None else rates[_bucket(match_len)]
        own = self._requests.get(request_id)
        return own.rate(prior, REQUEST_PRIOR_WEIGHT) if own else prior

    def record(self, request_id: str, match_len: int, num_drafts: int, num_accepted: int) -> None:
        rejected = float(num_accepted < num_drafts)
        for c in (self._requests.setdefault(request_id, _Counts()), self._buckets[_bucket(match_len)]):
            c.accepted += num_accepted
            c.rejected += rejected

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def observe_step(self, num_tokens: int, num_draft_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from a step: decode-only steps teach the overhead (without drafts) or the drafts' cost
        scale (with them); a step with prompt work has other costs (its attention, and f extrapolated
        past the profile) and teaches neither."""
        for b in self._buckets:
            b.accepted *= BUCKET_DECAY
            b.rejected *= BUCKET_DECAY
        if self.cost is None or num_prompt_tokens:
            return
        base = num_tokens - num_draft_tokens
        if not num_draft_tokens:
            sample = max(seconds - self.cost(base), 0.0)
            self.overhead_s += OVERHEAD_EWMA * (sample - self.overhead_s)
            return
        extra = self.cost(num_tokens) - self.cost(base)
        if extra > 0:
            lo, hi = DRAFT_COST_SCALE_RANGE
            sample = min(max((seconds - self.overhead_s - self.cost(base)) / extra, lo), hi)
            self.draft_cost_scale += OVERHEAD_EWMA * (sample - self.draft_cost_scale)

    def choose(self, request_ids: list[str], available: list[int], match_lens: list[int] | None = None,
               prompt_tokens: int = 0, budget: int = 1 << 30) -> list[int]:
        """Of available[i] drafts of request i (resting on matches of match_lens[i] tokens; None:
        not proposed yet, assume the best), how many to verify next step. prompt_tokens are waiting
        to be computed, within a step budget of `budget` tokens: they are work as useful as output
        tokens, and a draft that takes their place in a full step costs one of them."""
        if self.cost is None:
            return [min(a, self.num_speculative_tokens) for a in available]
        n = len(request_ids)
        if n + min(prompt_tokens, budget) >= self.knee:
            return [0] * len(available)
        lens = match_lens or [None] * len(request_ids)
        alphas = [self.acceptance(rid, m) for rid, m in zip(request_ids, lens, strict=True)]
        # Every candidate draft as (expected yield, request); a request's yields fall with j, so the
        # best prefix of this order holds a prefix of each request's drafts.
        yields = [(alpha ** j, i) for i, (alpha, a) in enumerate(zip(alphas, available, strict=True))
                  for j in range(1, min(a, self.num_speculative_tokens) + 1)]
        if not yields:
            return [0] * len(available)
        yields.sort(key=lambda y: -y[0])
        drafts = np.arange(len(yields) + 1)
        prompts = np.clip(budget - n - drafts, 0, prompt_tokens)
        gained = n + prompts + np.cumsum([0.0] + [y for y, _ in yields])
        base = np.array([self.cost(t) for t in n + prompts])
        steps = self.overhead_s + base + self.draft_cost_scale * (
            np.array([self.cost(t) for t in n + prompts + drafts]) - base)
        best = int(np.argmax(gained / steps))
        counts = [0] * len(available)
        for _, i in yields[:best]:
            counts[i] += 1
        return counts
