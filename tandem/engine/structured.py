"""Structured outputs: a token mask per step from llguidance, so that every sampled token keeps the
output inside its grammar (a JSON schema, a regex, a choice, a Lark grammar).

Each constrained request gets an LLMatcher in the engine that samples for it (the colocated core, a
prefill worker for the first token, a decode worker for the rest). A matcher is made on first use
and fed the request's tokens so far, so a request that arrives with output (a decode worker's, after
its prefill worker sampled the first token; a preempted one) resumes exactly where it was. The mask
of the requests sampling this step is computed on a thread while the model runs (llguidance drops
the GIL), applied to their logits rows before sampling, and the sampled tokens are fed back after.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.engine.grammars import Grammars

if TYPE_CHECKING:
    from tandem.engine.request import Request


class StructuredState:
    """The engine's matchers, by request id; the masks of a step; the tokens fed back."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.matchers: dict[str, Any] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="structured-mask")

    def _matcher(self, request: Request) -> Any:
        m = self.matchers.get(request.request_id)
        if m is None:
            so = request.sampling_params.structured
            assert so is not None
            m = self.grammars.matcher(so)
            for token in request.output_token_ids:  # resumed with output already: catch up
                if not m.consume_token(token):
                    raise ValueError(f"request {request.request_id}'s output left its grammar")
            self.matchers[request.request_id] = m
        return m

    def start_masks(self, sampling: list[Request]) -> Future | None:
        """Begin the masks of this step's sampling rows (those with a grammar) on the mask thread:
        (row indices, bitmask) when the future is read, or None when no row is constrained."""
        rows = [i for i, r in enumerate(sampling) if r.sampling_params.structured is not None]
        if not rows:
            return None
        matchers = [self._matcher(sampling[i]) for i in rows]  # made here: errors surface in this step
        return self._pool.submit(self._fill, rows, matchers)

    def _fill(self, rows: list[int], matchers: list[Any]) -> tuple[list[int], torch.Tensor]:
        # llguidance.numpy, not llguidance.torch: that one imports torch._dynamo (a second, on the
        # first constrained step).
        import llguidance.numpy as lln

        mask = lln.allocate_token_bitmask(len(rows), self.grammars.ll.vocab_size)
        for n, m in enumerate(matchers):
            lln.fill_next_token_bitmask(m, mask, n)
        return rows, disallowed_tokens(mask, self.grammars.vocab_size or self.grammars.ll.vocab_size)

    def advance(self, request_id: str, tokens: list[int]) -> None:
        m = self.matchers.get(request_id)
        if m is not None:
            for t in tokens:
                m.consume_token(t)

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)


def disallowed_tokens(mask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's packed bitmask [R, ceil(V/32)] int32 (bit j of word w: token 32w + j) as the bool
    [R, V] of tokens it forbids. Unpacked on the mask thread, so the step only does a masked fill;
    llguidance.torch's own CPU apply took 20 ms a row here."""
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits == 0)


def apply_masks(logits: torch.Tensor, masks: tuple[list[int], torch.Tensor] | None) -> torch.Tensor:
    """logits [R, V]: the constrained rows' disallowed tokens set to -inf, in place."""
    if masks is None:
        return logits
    rows, forbidden = masks
    with torch.inference_mode():  # the model's logits are inference tensors: updated in place there
        if len(rows) == logits.shape[0]:  # every row constrained: no gather
            return logits.masked_fill_(forbidden, float("-inf"))
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill_(forbidden, float("-inf"))
    return logits
