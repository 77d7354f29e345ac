"""Batch invariance (`--deterministic`, the default; ops/batch_invariant.h): each row's result is the
same whatever is computed beside it, so greedy output and logprobs are bit-identical alone or
batched, from the prefix cache or not, prefilled whole or in chunks, in the default dtype.

The kernels first (a row of a linear layer in any row count, a sequence's decode attention in any
batch and thread count, a prompt row's prefill attention under any split of its context), then the
engine end to end, in bfloat16 where the CPU computes it natively (the shipped default)."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.ops import extension

pytestmark = pytest.mark.skipif(extension.extension_isa() != "avx512-bf16",
                                reason="the batch-invariant kernels are the AVX512-BF16 build's (bfloat16 default); "
                                       "this CPU runs float32 through PyTorch's fallbacks, which promise no invariance")

WORDS = ["cat", "banana", "robot", "whale", "tree", "clock", "ghost", "mountain"]
PROMPTS = [f"Write a long story about a {w} who learns to sing. It begins on a rainy day in the old town, where"
           for w in WORDS]
GREEDY = SamplingParams(temperature=0, max_tokens=128, logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _invariant_kernels() -> None:
    extension.set_batch_invariant(True)  # as every engine sets it (tests below build engines of both kinds)


def test_a_linear_rows_sums_do_not_depend_on_the_rows_beside_it() -> None:
    torch.manual_seed(0)
    for n, k in [(96, 576), (1536, 576), (45, 130)]:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        bias = torch.randn(n, dtype=torch.bfloat16)
        packed = torch.ops.tandem.pack_linear_weight(weight)
        x = torch.randn(70, k, dtype=torch.bfloat16)
        whole = torch.ops.tandem.small_batch_linear(x, packed, bias, n)
        torch.testing.assert_close(whole.float(), torch.nn.functional.linear(x.float(), weight.float(),
                                                                               bias.float()), atol=0.05, rtol=0.02)
        for start, rows in [(0, 1), (0, 2), (3, 4), (5, 6), (1, 7), (0, 16), (9, 17), (2, 33), (0, 64)]:
            part = torch.ops.tandem.small_batch_linear(x[start:start + rows], packed, bias, n)
            assert torch.equal(part, whole[start:start + rows]), (n, k, start, rows)


def _attention_inputs(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    heads, kv_heads, d, bs, blocks = 9, 3, 64, 16, 96
    k = torch.randn(blocks, bs, kv_heads, d, dtype=torch.bfloat16)
    v = torch.randn(blocks, bs, kv_heads, d, dtype=torch.bfloat16)
    return heads, d, k, v


def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch_or_threads() -> None:
    from tandem.ops.paged_attention import paged_decode_attention

    heads, d, k, v = _attention_inputs()
    lengths = [700, 5, 300, 1000, 33]  # several 256-token parts and one
    tables = torch.stack([torch.randperm(96, dtype=torch.int32)[:64] for _ in lengths])
    q = torch.randn(len(lengths), heads, d, dtype=torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32)
    batch = paged_decode_attention(q, k, v, tables, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in {1, threads}:
            torch.set_num_threads(n)
            for i in range(len(lengths)):
                alone = paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], 0.125)
                assert torch.equal(alone[0], batch[i]), (n, lengths[i])
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_of_a_row_does_not_depend_on_how_its_context_was_split() -> None:
    from tandem.ops.paged_attention import paged_prefill_attention

    heads, d, k, v = _attention_inputs(1)
    length = 300
    table = torch.randperm(96, dtype=torch.int32)[None, :32]
    q = torch.randn(length, heads, d, dtype=torch.bfloat16)

    def rows(context: int, beside: int = 0) -> torch.Tensor:
        """The rows past `context` cached tokens, optionally after another sequence's `beside` rows."""
        n = length - context
        qs = torch.cat([torch.randn(beside, heads, d, dtype=torch.bfloat16), q[context:]])
        starts = torch.tensor([0, beside, beside + n] if beside else [0, n], dtype=torch.int32)
        tables = torch.cat([table, table]) if beside else table
        lens = torch.tensor([beside, length] if beside else [length], dtype=torch.int32)
        return paged_prefill_attention(qs, k, v, tables, starts, lens, 0.125)[beside:]

    whole = rows(0)
    for context in (16, 64, 100, 250, 298, 299):  # a cached prefix, chunked prefill, a one-token tail
        assert torch.equal(rows(context), whole[context:]), context
    assert torch.equal(rows(299, beside=200), whole[299:]), "a one-token tail beside a long prompt"


@pytest.fixture(scope="module")
def llm(make_llm):  # noqa: ANN001, ANN201
    return make_llm()  # the shipped defaults (bfloat16 here, batch-invariant kernels), a small pool


def signature(out) -> tuple:  # noqa: ANN001
    """Its tokens and, per token, the logprobs of the two likeliest: compared bit for bit."""
    c = out.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]


@pytest.mark.slow
def test_greedy_output_is_identical_alone_cached_batched_and_chunked(llm, make_llm) -> None:  # noqa: ANN001
    alone = [signature(llm.generate(p, GREEDY, use_tqdm=False)[0]) for p in PROMPTS]
    assert all(len(a[0]) == 128 for a in alone)
    cached = [signature(llm.generate(p, GREEDY, use_tqdm=False)[0]) for p in PROMPTS]
    assert llm.engine.core.scheduler.kv.pool.num_blocks > 0
    assert cached == alone, "a prefix-cache hit"
    batched = [signature(o) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert batched == alone, "beside seven others"
    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [signature(o) for o in chunked.generate(PROMPTS, GREEDY, use_tqdm=False)] == alone, "16-token chunks"


@pytest.mark.slow
def test_the_batch_dependent_kernels_do_differ(make_llm) -> None:  # noqa: ANN001
    """--no-deterministic: the fast paths the invariant ones replace do change some outputs, so the
    identity above is the kernels' doing, not the prompts'."""
    fast = make_llm(deterministic=False)
    try:
        alone = [signature(fast.generate(p, GREEDY, use_tqdm=False)[0]) for p in PROMPTS[:4]]
        batched = [signature(o) for o in fast.generate(PROMPTS, GREEDY, use_tqdm=False)[:4]]
    finally:
        extension.set_batch_invariant(True)
    assert batched != alone


def test_seeded_sampling_gives_the_same_text_alone_or_batched(llm) -> None:  # noqa: ANN001
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    alone = [llm.generate(p, s, use_tqdm=False)[0].outputs[0].token_ids
             for p, s in zip(PROMPTS[:4], params, strict=True)]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert batched == alone
