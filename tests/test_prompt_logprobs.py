"""Prompt logprobs (SamplingParams.prompt_logprobs; the completions API's echo with logprobs, which
log-likelihood evaluations read): every prompt token's logprob, rank and top tokens equal
transformers' on the same weights, whole or in prefill chunks, and a cached prefix does not skip
any of them."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_utils import running_server

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


def test_echo_with_logprobs_scores_the_prompt_through_the_api(hf_reference) -> None:  # noqa: ANN001
    """What lm-eval's local-completions sends for a log-likelihood: token ids, echo, logprobs=1,
    max_tokens=1; the first token has none, the rest are the prompt's, then the generated one."""
    with running_server("--dtype", "float32", "--kv-cache-memory", "0.25") as server:
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
        body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        for _ in range(2):
            choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = reference(hf_reference, ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(ids)]), want, atol=2e-4, rtol=0)
            assert choice["text"].startswith(PROMPTS[0])
            assert "".join(lp["tokens"][:len(ids)]) == PROMPTS[0]
            assert lp["text_offset"][0] == 0
        streamed: list[float | None] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        streamed += c["logprobs"]["token_logprobs"]
        assert streamed == lp["token_logprobs"]
