"""Speculative decoding in the engine core: after each step, drafts for the requests that decode
next; after the step that verified them, what was accepted.

The scheduler schedules a request's drafts with its next token (spec_token_ids) and trims them to
the budget and the free blocks; the runner computes a logits row after each; the sampler accepts
the longest prefix that its rows agree with and adds one token (sampler.py); the scheduler keeps
the accepted drafts' KV and drops the rest (their slots are overwritten, and a block is hashed
into the prefix cache only once every token in it is an accepted one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.config import SpeculativeConfig
from tandem.speculative.factory import make_proposer
from tandem.speculative.policy import SpecPolicy, StepCost
from tandem.speculative.proposer import Proposer, SpecRequest


@dataclass
class SpecStats:
    """Running totals, vLLM's spec_decode_* counters: verifications with at least one draft, drafts
    verified, drafts accepted, and drafts accepted at each position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost: StepCost | None,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config)
        self.policy = SpecPolicy(config.num_speculative_tokens, cost if config.adaptive else None)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._match_len: dict[str, int] = {}  # of the drafts in flight, by request

    def propose(self, decoding: Sequence[SpecRequest], prompt_tokens: int = 0,
                budget: int = 1 << 30) -> list[list[int]]:
        """The drafts to verify next step with each of `decoding` (the requests that decode next
        step and may have drafts: the engine picks them), maybe none; prompt_tokens wait to be
        computed within a step budget of `budget` tokens."""
        drafts_out: list[list[int]] = [[] for _ in decoding]
        if not decoding:
            return drafts_out
        ids = [r.request_id for r in decoding]
        caps = self.policy.choose(ids, [self._room(r) for r in decoding], None, prompt_tokens, budget)
        asked = [i for i, c in enumerate(caps) if c > 0]
        if not asked:
            return drafts_out
        proposals = self.proposer.propose([decoding[i] for i in asked], [caps[i] for i in asked])
        available, match_lens = [0] * len(decoding), [0] * len(decoding)
        for i, drafts in zip(asked, proposals, strict=True):
            available[i], match_lens[i] = len(drafts.tokens), drafts.match_len
        keep = self.policy.choose(ids, available, match_lens, prompt_tokens, budget)
        for i, drafts in zip(asked, proposals, strict=True):
            if keep[i]:
                drafts_out[i] = drafts.tokens[:keep[i]]
                self._match_len[decoding[i].request_id] = drafts.match_len
        return drafts_out

    def _room(self, request: SpecRequest) -> int:
        """Drafts that could still become output: max_tokens and the context each leave room for
        all but the step's own token."""
        room = self.max_model_len - request.num_tokens - 1
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return max(min(room, self.config.num_speculative_tokens), 0)

    def verified(self, request_id: str, num_drafts: int, tokens: list[int]) -> None:
        """A step verified num_drafts drafts of the request and sampled `tokens` (accepted + 1)."""
        if not num_drafts:
            return
        accepted = len(tokens) - 1
        self.policy.record(request_id, self._match_len.pop(request_id, 0), num_drafts, accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_pos[pos] += 1

    def observe_step(self, num_tokens: int, num_draft_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        self.policy.observe_step(num_tokens, num_draft_tokens, num_prompt_tokens, seconds)

    def finish(self, request: SpecRequest, completed: bool) -> None:
        """The request left the engine: its state goes; the output of one that completed normally
        (not aborted, not failed) teaches the proposer."""
        self.policy.forget(request.request_id)
        self._match_len.pop(request.request_id, None)
        self.proposer.finish(request, completed)
