"""Prompt logprobs (SamplingParams.prompt_logprobs; the completions API's echo with logprobs, which
log-likelihood evaluations read): every prompt token's logprob, rank and top tokens equal
transformers' on the same weights, whole or in prefill chunks, and a cached prefix does not skip
any of them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import FP32_SERVER
from server_utils import web

from tandem import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side.",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)"]
TOP = 3


def reference(hf_model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """transformers' log-softmax at each prompt position but the last: row i scores token i + 1."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked-16"])
def test_prompt_logprobs_equal_transformers(make_llm, hf_reference, options: dict) -> None:  # noqa: ANN001
    llm = make_llm(dtype="float32", **options)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)
    for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
            ids = tokenizer.encode(prompt)
            assert out.prompt_token_ids == ids
            plp = out.prompt_logprobs
            assert plp is not None and len(plp) == len(ids) and plp[0] is None
            ref = reference(hf_reference, ids)
            want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            got = torch.tensor([plp[i][ids[i]].logprob for i in range(1, len(ids))])
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
            for i in range(1, len(ids)):
                row, own = ref[i - 1], plp[i][ids[i]]
                top = [t for t, e in sorted(plp[i].items(), key=lambda kv: kv[1].rank) if e.rank <= TOP]
                assert top == row.topk(TOP).indices.tolist(), i
                # Its rank: the reference's, give or take the tokens within rounding of its logprob.
                close = int(((row - want[i - 1]).abs() < 2e-4).sum())
                assert abs(own.rank - (int((row > want[i - 1]).sum()) + 1)) < close + 1, i


def test_echo_with_logprobs_scores_the_prompt_through_the_api(hf_reference, shared_server) -> None:  # noqa: ANN001
    """What lm-eval's local-completions sends for a log-likelihood: token ids, echo, logprobs=1,
    max_tokens=1; the first token has none, the rest are the prompt's, then the generated one
    (float32: compared with transformers in float32)."""
    server = shared_server(*FP32_SERVER)
    ids = web.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    for _ in range(2):
        choice = web.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference(hf_reference, ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(ids)]), want, atol=2e-4, rtol=0)
        assert choice["text"].startswith(PROMPTS[0])
        assert "".join(lp["tokens"][:len(ids)]) == PROMPTS[0]
        assert lp["text_offset"][0] == 0
    streamed: list[float | None] = []
    with web.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["logprobs"]["token_logprobs"]
    assert streamed == lp["token_logprobs"]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked-16"])
def test_n_samples_score_the_prompt_once(make_llm, monkeypatch, options: dict) -> None:  # noqa: ANN001
    """n=3 with prompt logprobs: the same prompt logprobs and greedy tokens as n=1, the prompt scored
    by one child only, and the other two reading its blocks from the prefix cache."""
    import tandem.engine.runner as runner_module

    llm = make_llm(dtype="float32", **options)
    runner = llm.engine.core.runner
    scored_rows: list[int] = []
    prompt_tokens: dict[str, int] = {}  # child id -> prompt tokens it computed
    real_score, real_execute = runner_module.token_logprobs, runner.execute

    def score(logits, token_ids, num_top):  # noqa: ANN001, ANN202
        scored_rows.append(len(token_ids))
        return real_score(logits, token_ids, num_top)

    def execute(sched):  # noqa: ANN001, ANN202
        for s in sched.scheduled:
            r = s.request
            prompt_tokens[r.request_id] = prompt_tokens.get(r.request_id, 0) + max(
                0, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - r.num_computed_tokens)
        return real_execute(sched)

    monkeypatch.setattr(runner_module, "token_logprobs", score)
    monkeypatch.setattr(runner, "execute", execute)
    # A prompt of its own per parametrization, so that no earlier run's blocks are in the cache.
    prompt = f"{PROMPTS[1]}\n# {options}"
    block_size = llm.engine.config.cache.block_size
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)

    three = llm.generate([prompt], replace(params, n=3))[0]
    ids = three.prompt_token_ids
    assert len(ids) > 2 * block_size  # blocks to share
    assert sum(scored_rows) == len(ids) - 1  # three children scoring would be 3x
    children = sorted(prompt_tokens)
    assert len(children) == 3 and prompt_tokens[children[0]] == len(ids)  # the scorer: every position
    # The others read its blocks from the prefix cache: whole, all its full blocks; in chunks, at least one.
    shared = (len(ids) - 1) // block_size * block_size if not options else block_size
    assert all(prompt_tokens[c] <= len(ids) - shared for c in children[1:]), prompt_tokens

    scored_rows.clear()
    one = llm.generate([prompt], params)[0]
    assert sum(scored_rows) == len(ids) - 1
    # The same entries; the values to rounding (another batch shape sums in another order).
    got, want = three.prompt_logprobs, one.prompt_logprobs
    assert got is not None and want is not None and got[0] is None and len(got) == len(want) == len(ids)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert {t: e.rank for t, e in g.items()} == {t: e.rank for t, e in w.items()}
        torch.testing.assert_close([g[t].logprob for t in w], [e.logprob for e in w.values()], atol=1e-5, rtol=0)
    assert [o.token_ids for o in three.outputs] == [one.outputs[0].token_ids] * 3
