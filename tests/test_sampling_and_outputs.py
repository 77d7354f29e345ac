"""Sampling parameters, seeded reproducibility, stop conditions, logprobs and UTF-8 detokenization."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.request import Request
from tandem.engine.sampler import sample

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def test_seeded_sampling_independent_of_batch(llm_fp32) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm_fp32.chat(CHAT, params)[0].outputs[0].token_ids
    others = [[{"role": "user", "content": f"Count to {i}."}] for i in range(5)]
    noise = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    batch = llm_fp32.chat(others[:2] + [CHAT] + others[2:], [noise, noise, params, noise, noise, noise])
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm_fp32.chat(CHAT, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=20,
                                                    ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_cut_the_text(llm_fp32) -> None:  # noqa: ANN001
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm_fp32.chat(CHAT, greedy)[0].outputs[0].text
    words = full.split()
    assert len(words) > 4
    stop = words[3]
    out = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    kept = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_stop_token_ids_max_and_min_tokens(llm_fp32) -> None:  # noqa: ANN001
    greedy = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    third = greedy.token_ids[2]
    out = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[third]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:3] and out.finish_reason == "stop" and out.stop_reason == third
    out = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    # The greedy answer ends with EOS; min_tokens forbids it until enough tokens exist.
    short = llm_fp32.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=60))
    n = len(short[0].outputs[0].token_ids)
    assert short[0].outputs[0].finish_reason == "stop"
    longer = llm_fp32.chat([{"role": "user", "content": "Say hi."}],
                           SamplingParams(temperature=0, max_tokens=60, min_tokens=n + 3))[0].outputs[0]
    assert len(longer.token_ids) >= n + 3


def test_logprobs_are_the_models(llm_fp32, hf_reference) -> None:  # noqa: ANN001
    prompt = llm_fp32.get_tokenizer().encode("The capital of France is")
    out = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = ref.topk(3)
    entry = out.logprobs[0]
    assert list(entry)[:3] == top.indices.tolist()
    for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert entry[tid].logprob == pytest.approx(lp, abs=1e-3)
    assert entry[out.token_ids[0]].rank == 1
    assert out.cumulative_logprob == pytest.approx(top.values[0].item(), abs=1e-3)


def test_n_completions(llm_fp32) -> None:  # noqa: ANN001
    out = llm_fp32.chat(CHAT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def _req(params: SamplingParams, outputs: list[int] = (), prompt: list[int] = (3,)) -> Request:  # type: ignore[assignment]
    r = Request("x", list(prompt), params)
    for t in outputs:
        r.append_output_token(t)
    return r


def test_sampler_filters() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0, -1.0]])
    for params in (SamplingParams(temperature=1, top_k=1), SamplingParams(temperature=1, top_p=0.01),
                   SamplingParams(temperature=1, min_p=0.99)):
        r = _req(params)
        assert {sample(logits.clone(), [r]).token_ids[0][0] for _ in range(20)} == {0}
    # top_k=2 only ever yields the two best tokens, and both appear (a seeded request's noise is
    # drawn per output position: the same position always samples the same token).
    r = _req(SamplingParams(temperature=1, top_k=2, seed=3))
    assert len({sample(logits.clone(), [r]).token_ids[0][0] for _ in range(5)}) == 1
    seen = set()
    for _ in range(60):
        token = sample(logits.clone(), [r]).token_ids[0][0]
        seen.add(token)
        r.append_output_token(token)
    assert seen == {0, 1}


def test_penalties() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.5]])
    assert sample(logits.clone(), [_req(SamplingParams(temperature=0), [0])]).token_ids == [[0]]
    for params in (SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, frequency_penalty=0.5),
                   SamplingParams(temperature=0, repetition_penalty=1.2)):
        assert sample(logits.clone(), [_req(params, [0])]).token_ids == [[1]], params
    # The repetition penalty covers prompt tokens too (token 1 here); the others only outputs.
    strong = SamplingParams(temperature=0, repetition_penalty=100.0)
    assert sample(logits.clone(), [_req(strong, [0], prompt=[1])]).token_ids == [[4]]
    assert sample(logits.clone(), [_req(SamplingParams(temperature=0, presence_penalty=2.0), [0], prompt=[1])]
                  ).token_ids == [[1]]


def test_logit_bias_moves_greedy_and_random_rows_not_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.5]])
    assert sample(logits.clone(), [_req(SamplingParams(temperature=0, logit_bias={1: 0.2}), [])]).token_ids == [[1]]
    banned = SamplingParams(temperature=0, logit_bias={0: -100, 1: -100})
    assert sample(logits.clone(), [_req(banned, [])]).token_ids == [[4]]
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias={3: 100})
    assert {sample(logits.clone(), [_req(forced, [i])]).token_ids[0][0] for i in range(8)} == {3}
    # The logprobs reported are the model's, before the bias.
    out = sample(logits.clone(), [_req(SamplingParams(temperature=0, logprobs=0, logit_bias={4: 100}), [])])
    assert out.token_ids == [[4]]
    assert out.logprobs[0][0].token_logprob == pytest.approx(torch.log_softmax(logits[0], -1)[4].item(), abs=1e-6)


def test_utf8_incremental_detokenization(llm_fp32) -> None:  # noqa: ANN001
    tok = llm_fp32.get_tokenizer()
    text = "Café, naïve — 日本語のテキスト and emoji 🎉🚀 done."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens ended mid-character and were held back


def test_find_stop_earliest() -> None:
    assert find_stop("hello world, bye", 5, ["bye", "world"]) == (13, "bye")
    assert find_stop("abcSTOPdef", 10, ["STOP", "def"]) == (3, "STOP")
    assert find_stop("abc", 1, ["x"]) is None
