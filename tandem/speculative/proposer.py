"""What a proposer is: given running requests, guess each one's next tokens.

The engine asks after every step, for the requests that decode next step, with the most drafts
each may have (the policy's cap, what max_tokens and the context leave). A draft model or an
EAGLE-style head plugs in here as another Proposer; the model-free ones need no device at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class SpecRequest(Protocol):
    """What speculation reads of a request (the engine's Request is one). It is read only: which
    requests decode, and whether one completed, the engine says."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def tenant(self) -> str | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int | None: ...


@dataclass
class Drafts:
    tokens: list[int]
    match_len: int = 0  # the tokens of context the guess rests on: what its acceptance is estimated by


NO_DRAFTS = Drafts([])


class Proposer(Protocol):
    def propose(self, requests: Sequence[SpecRequest], max_drafts: list[int]) -> list[Drafts]:
        """Up to max_drafts[i] guessed tokens to follow requests[i]'s tokens (may be none)."""
        ...

    def finish(self, request: SpecRequest, completed: bool) -> None:
        """The request is done: drop its state (and, if it completed normally rather than being aborted
        or failed, learn from its output, if the proposer does)."""
        ...
