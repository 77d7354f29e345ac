"""The logprobs of one sampled (or scored) token: what the sampler emits, a request keeps for its
prompt, and the output processor turns into the API's Logprob entries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampleLogprobs:
    token_id: int
    token_logprob: float
    token_rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]
