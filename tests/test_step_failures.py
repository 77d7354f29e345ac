"""A request that makes a step fail harms only itself: the engine finds it by retrying the step
without it, fails it alone, and everyone else gets the tokens they would have had on their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.request import Request

POISON = 4242  # a token id the fault below refuses to compute
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)


@pytest.fixture
def poisoned(llm_fp32) -> Iterator[object]:  # noqa: ANN001
    """Make the model raise whenever a step computes the POISON token (a stand-in for any bug a
    request's contents can trigger past validation)."""
    model = llm_fp32.engine.core.runner.model
    forward = model.forward

    def failing_forward(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if (input_ids == POISON).any():
            raise RuntimeError("injected fault")
        return forward(input_ids, *args, **kwargs)

    model.forward = failing_forward
    try:
        yield llm_fp32
    finally:
        model.forward = forward


def prompts(passages: list[str], tokenizer: object, n: int) -> list[list[int]]:
    return [tokenizer.encode(p)[:40 + 7 * i] for i, p in enumerate(passages[:n])]  # type: ignore[attr-defined]


def test_poisoned_request_fails_alone_and_innocents_are_unchanged(poisoned, passages) -> None:  # noqa: ANN001
    innocents = prompts(passages, poisoned.get_tokenizer(), 5)
    params = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY]
    alone = [o.outputs[0].token_ids for o in poisoned.generate(innocents, params)]
    poison = innocents[0][:20] + [POISON] + innocents[1][:20]
    outs = poisoned.generate([innocents[0], innocents[1], poison, innocents[2], innocents[3], innocents[4]],
                             [params[0], params[1], GREEDY, params[2], params[3], params[4]])
    assert outs[2].outputs[0].finish_reason == "error"
    together = [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2]
    assert together == alone
    assert all(o.outputs[0].finish_reason == "length" for i, o in enumerate(outs) if i != 2)


def test_request_sharing_a_failed_requests_new_blocks_is_recomputed(poisoned, passages) -> None:  # noqa: ANN001
    """Both prompts start with the same 48 tokens; the poisoned one is scheduled first, so the other
    finds those blocks in the prefix cache within the same step, before anything wrote them."""
    core = poisoned.engine.core
    core.scheduler.kv.reset_prefix_cache()
    shared = poisoned.get_tokenizer().encode(passages[6])[:48]
    assert len(shared) == 48
    innocent = shared + poisoned.get_tokenizer().encode(passages[7])[:10]
    alone = poisoned.generate([innocent], GREEDY)[0].outputs[0].token_ids
    core.scheduler.kv.reset_prefix_cache()
    preemptions = core.scheduler.num_preemptions
    outs = poisoned.generate([shared + [POISON, 5, 6], innocent], GREEDY)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == alone
    assert core.scheduler.num_preemptions == preemptions + 1  # it was undone and computed again
    # The shared blocks found now are the ones the innocent's recompute wrote, not the failed step's.
    hits, _ = core.scheduler.kv.get_computed_blocks(Request("probe", shared + [POISON], GREEDY))
    assert len(hits) == 3


def test_every_request_failing_leaves_the_engine_serving(poisoned) -> None:  # noqa: ANN001
    outs = poisoned.generate([[1, POISON, 2], [POISON, 3]], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert len(poisoned.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 8
