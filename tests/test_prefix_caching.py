"""Prefix caching: identical greedy outputs with it on and off (multi-turn, chunked prefill and
preemption forced), real hits on shared prefixes, tenant isolation through the salt."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tandem import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run_conversations(llm, passages: list[str], turns: int = 3) -> list[list[int]]:  # noqa: ANN001
    """Three conversations advanced turn by turn, all of a turn's requests in one batch."""
    convs = [[{"role": "system", "content": passages[i]}] for i in range(3)]
    outputs = []
    for t in range(turns):
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"Question {t}: summarise part {i + t} in one line."})
        outs = llm.chat(convs, GREEDY)
        for conv, out in zip(convs, outs, strict=True):
            conv.append({"role": "assistant", "content": out.outputs[0].text})
            outputs.append(out.outputs[0].token_ids)
    return outputs


@pytest.mark.slow
def test_multi_turn_identical_with_and_without_caching(make_llm, passages) -> None:  # noqa: ANN001
    # 20 blocks hold 320 tokens: two conversations of ~200 tokens cannot both stay resident.
    options = dict(dtype="float32", max_num_batched_tokens=64, num_blocks=20)
    on = make_llm(enable_prefix_caching=True, **options)
    off = make_llm(enable_prefix_caching=False, **options)
    with_cache = run_conversations(on, passages, turns=2)
    without = run_conversations(off, passages, turns=2)
    assert with_cache == without
    stats = on.engine.core.scheduler.kv.prefix_stats
    assert stats.hits > 0, "later turns must hit the earlier turns' blocks"
    assert off.engine.core.scheduler.kv.prefix_stats.hits == 0
    assert on.engine.core.scheduler.num_preemptions > 0 and off.engine.core.scheduler.num_preemptions > 0


def test_shared_prefix_hits_and_salts(llm_fp32, passages) -> None:  # noqa: ANN001
    tok = llm_fp32.get_tokenizer()
    prefix = tok.encode(" ".join(passages[:3]))[:256]  # 16 full blocks
    kv = llm_fp32.engine.core.scheduler.kv
    llm_fp32.generate([prefix + [100]], GREEDY)  # warm the cache
    before = (kv.prefix_stats.queries, kv.prefix_stats.hits)
    outs = llm_fp32.generate([prefix + [200 + i] for i in range(4)], GREEDY)
    assert all(o.num_cached_tokens == 256 for o in outs)
    assert kv.prefix_stats.hits - before[1] == 4 * 256
    assert kv.prefix_stats.queries - before[0] == 4 * 257
    # Another tenant's salt sees nothing of it, and its own second request hits its own blocks.
    salted = llm_fp32.generate([{"prompt_token_ids": prefix + [300], "cache_salt": "tenant-b"}], GREEDY)
    assert salted[0].num_cached_tokens == 0
    again = llm_fp32.generate([{"prompt_token_ids": prefix + [301], "cache_salt": "tenant-b"}], GREEDY)
    assert again[0].num_cached_tokens == 256
    # Cached or not, the answer is the same.
    fresh = llm_fp32.generate([{"prompt_token_ids": prefix + [200], "cache_salt": "tenant-c"}], GREEDY)
    assert fresh[0].num_cached_tokens == 0
    assert fresh[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_block_hashes_are_equal_in_another_process(algo: str) -> None:
    """A router or another worker must compute the same keys (Python 3.11's hash(None) does not)."""
    code = ("from tandem.kv.hashing import HASH_FUNCTIONS, extend_block_hashes, salt_key\n"
            "h = []\n"
            f"extend_block_hashes(h, list(range(64)), 16, HASH_FUNCTIONS[{algo!r}], salt_key('tenant'))\n"
            "print(h)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and len(ast.literal_eval(runs[0])) == 4
