"""Greedy float32 decoding matches Hugging Face transformers token for token on the default model,
for one batch of prompts from 1 to over 1,000 tokens: with the default budget, with a 64-token
budget (every long prompt is chunked), and with a pool so small that requests are preempted."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from tandem import SamplingParams

MAX_NEW = 24
LENGTHS = [1, 7, 33, 130, 300, 517, 800, 1100]


@pytest.fixture(scope="module")
def prompts(llm_fp32, passages) -> list[list[int]]:  # noqa: ANN001
    tok = llm_fp32.get_tokenizer()
    long_ids = tok.encode(" ".join(passages + passages[::-1]))
    assert len(long_ids) > max(LENGTHS)
    # Each prompt starts at a different passage so that no two share a prefix by accident.
    return [tok.encode(" ".join(passages[i % len(passages):] + passages))[:n] if n > 1 else [long_ids[0]]
            for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(hf_reference, prompts) -> list[list[int]]:  # noqa: ANN001
    return [hf_greedy(hf_reference, p, MAX_NEW) for p in prompts]


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 64},
    {"num_blocks": 90, "max_num_batched_tokens": 256},
], ids=["default", "chunked-64", "preempting"])
def test_greedy_matches_transformers(make_llm, prompts, reference, options) -> None:  # noqa: ANN001
    llm = make_llm(dtype="float32", enable_prefix_caching=False, **options)
    outs = llm.generate(prompts, PARAMS)
    got = [o.outputs[0].token_ids for o in outs]
    for n, g, ref in zip(LENGTHS, got, reference, strict=True):
        assert g == ref, f"prompt of {n} tokens diverged"
    if "num_blocks" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
