"""lm-evaluation-harness against the server, offline: `local-completions` with the remote tokenizer
(GET /tokenizer_info, /tokenize, /detokenize) scores the shipped task (evals/tandem_python) by
log-likelihood (echo + prompt logprobs), and every item's choice and every continuation's
log-likelihood equal the same harness's on transformers with the same weights; and
`local-chat-completions` runs a generative task through the chat API."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from conftest import FP32_SERVER, load_hf_gguf_tokenizer
from server_utils import web

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "evals/tandem_python"

pytestmark = pytest.mark.slow
MC_LIMIT = 12  # of the 51 items (each item's 4 choices are scored on both sides)
GEN_LIMIT = 3  # of the 19 Zen items


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


@pytest.fixture(scope="module")
def server(shared_server):  # noqa: ANN001, ANN201
    """float32: every score and reply is compared with transformers' in float32."""
    return shared_server(*FP32_SERVER)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path: Path):  # noqa: ANN201
    """The transformers tokenizer of the model's GGUF file, for the harness's HFLM."""
    return load_hf_gguf_tokenizer(default_model_path)


@functools.cache
def _shipped_tasks():  # noqa: ANN202
    """The shipped tasks only: indexing lm-eval's own thousands of task files cost 8 s a call."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(model: object, tasks: list[str], chat: bool = False, model_args: dict | None = None,
             limit: int | None = None) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args or None, tasks=tasks, log_samples=True,
                                   apply_chat_template=chat, task_manager=_shipped_tasks(),
                                   random_seed=0, limit=limit)


def per_item(result: dict, task: str) -> list[list[float]]:
    """Each item's continuations' log-likelihoods, in document order."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_the_shipped_task_scores_the_same_as_on_transformers(server, hf_reference, hf_tokenizer) -> None:  # noqa: ANN001
    from lm_eval.models.huggingface import HFLM

    info = web.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    ours = evaluate("local-completions", ["tandem_python"], model_args={
        "base_url": f"{server.url}/v1/completions", "model": "SmolLM2-135M-Instruct",
        "tokenizer_backend": "remote", "num_concurrent": 8, "max_retries": 1}, limit=MC_LIMIT)
    theirs = evaluate(HFLM(pretrained=hf_reference, tokenizer=hf_tokenizer, batch_size=32), ["tandem_python"],
                      limit=MC_LIMIT)
    a, b = per_item(ours, "tandem_python"), per_item(theirs, "tandem_python")
    assert len(a) == len(b) == min(MC_LIMIT, sum(1 for _ in (TASKS / "python_mc.jsonl").open()))
    for item, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.index(max(x)) == y.index(max(y)), item  # the same choice
        assert max(abs(p - q) for p, q in zip(x, y, strict=True)) < 2e-3, (item, x, y)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tandem_python"][metric] == theirs["results"]["tandem_python"][metric]
    assert 0.4 < ours["results"]["tandem_python"]["acc,none"] <= 1.0  # well above chance (0.25)


def test_chat_completions_generate_what_transformers_generates(server, hf_reference,  # noqa: ANN001
                                                                hf_tokenizer) -> None:
    """local-chat-completions on the generative task (greedy, through the chat template): every
    reply equals the harness's own generation on transformers with the same template (the first
    LIMIT items: transformers generates one at a time)."""
    from lm_eval.models.huggingface import HFLM

    ours = evaluate("local-chat-completions", ["tandem_python_gen"], chat=True, model_args={
        "base_url": f"{server.url}/v1/chat/completions", "model": "SmolLM2-135M-Instruct",
        "tokenizer_backend": "none", "num_concurrent": 4, "max_retries": 1}, limit=GEN_LIMIT)
    theirs = evaluate(HFLM(pretrained=hf_reference, tokenizer=hf_tokenizer, batch_size=1), ["tandem_python_gen"],
                      chat=True, limit=GEN_LIMIT)
    replies = [[s["resps"][0][0] for s in sorted(r["samples"]["tandem_python_gen"], key=lambda s: s["doc_id"])]
               for r in (ours, theirs)]
    assert len(replies[0]) == GEN_LIMIT
    assert any(replies[0]) and replies[0] == replies[1], list(zip(*replies, strict=True))
    assert ours["results"]["tandem_python_gen"]["exact_match,none"] == \
        theirs["results"]["tandem_python_gen"]["exact_match,none"]
