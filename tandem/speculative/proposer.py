"""What a proposer is: given running requests, guess each one's next tokens.

The engine asks after every step, for the requests that decode next step, with the most drafts
each may have (the policy's cap, what max_tokens and the context leave). A draft model or an
EAGLE-style head plugs in here as another Proposer; the model-free ones need no device at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.config import SpeculativeConfig
from tandem.engine.request import Request


@dataclass
class Drafts:
    tokens: list[int]
    match_len: int = 0  # the tokens of context the guess rests on: what its acceptance is estimated by


NO_DRAFTS = Drafts([])


class Proposer(Protocol):
    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[Drafts]:
        """Up to max_drafts[i] guessed tokens to follow requests[i]'s tokens (may be none)."""
        ...

    def finish(self, request: Request) -> None:
        """The request is done: drop its state (and learn from its output, if the proposer does)."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from tandem.speculative.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    from tandem.speculative.suffix import SuffixProposer

    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
