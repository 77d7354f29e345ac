"""Reasoning set apart from the answer (--reasoning-parser): the parser on known replies, the same
split however a reply's stream is cut, the template variables a request may and may not set, and a
server with `--reasoning-parser qwen3` giving reasoning_content in chat and thinking blocks in
Messages, streamed equal to whole."""

from __future__ import annotations

import asyncio
import json
import random

import anthropic
import pytest
from conftest import DEFAULT_SERVER
from server_utils import web

from tandem.serve.errors import APIError
from tandem.serve.reasoning import DEEPSEEK_R1, QWEN3, ReasoningParser, Split, split_reply
from tandem.serve.text_worker import TextWorker
from tandem.tokenizer import load_tokenizer

CASES = [  # (format, prompt opened the reasoning, reply, reasoning, content)
    (QWEN3, False, "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    (QWEN3, False, "  <think>x</think>y", "x", "y"),
    (QWEN3, False, "It is 4.", "", "It is 4."),
    (QWEN3, False, "  It is <think>4</think>.", "", "  It is <think>4</think>."),  # not at the start: content
    (QWEN3, False, "<thin", "", "<thin"),  # a tag cut short is text
    (QWEN3, False, "<think>cut short", "cut short", ""),
    (QWEN3, True, "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (QWEN3, False, "<think></think>\n\nNo thoughts.", "", "No thoughts."),
    (DEEPSEEK_R1, False, "Let me add.\n</think>\n\nIt is 4.", "Let me add.\n", "It is 4."),
    (DEEPSEEK_R1, False, "<think>Let me add.</think>4", "Let me add.", "4"),
    (DEEPSEEK_R1, False, "Still thinking when max_tokens", "Still thinking when max_tokens", ""),
    (DEEPSEEK_R1, False, "a </thi", "a </thi", ""),
]


@pytest.mark.parametrize(("fmt", "opened", "reply", "reasoning", "content"), CASES)
def test_known_replies_split(fmt, opened, reply, reasoning, content) -> None:  # noqa: ANN001
    assert split_reply(fmt, reply, opened) == Split(reasoning, content)


@pytest.mark.parametrize(("fmt", "opened", "reply"), [(f, o, r) for f, o, r, _, _ in CASES])
def test_a_stream_cut_anywhere_splits_as_the_whole_reply(fmt, opened, reply) -> None:  # noqa: ANN001
    whole = split_reply(fmt, reply, opened)
    rng = random.Random(reply)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 6)))) if len(reply) > 1 \
            else []
        parser, got = ReasoningParser(fmt, opened), Split()
        for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True):
            got.extend(parser.feed(reply[a:b]))
        got.extend(parser.finish())
        assert got == whole, cuts
    one_by_one = ReasoningParser(fmt, opened)  # character by character, as a token-by-token stream can be
    got = Split()
    for char in reply:
        got.extend(one_by_one.feed(char))
    got.extend(one_by_one.finish())
    assert got == whole


def test_template_variables_reach_the_template_but_never_the_renderers_arguments() -> None:
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    worker = TextWorker(tokenizer, 1_000_000, None)
    hi = [{"role": "user", "content": "hi"}]
    try:
        plain = asyncio.run(worker.chat_ids(hi, True))
        off = asyncio.run(worker.chat_ids(hi, True, kwargs={"enable_thinking": False}))
        assert tokenizer.decode(plain) == "hi" and tokenizer.decode(off) == "/no_think hi"
        for key in ("chat_template", "tokenize", "add_generation_prompt", "tools"):
            with pytest.raises(APIError) as e:
                asyncio.run(worker.chat_ids(hi, True, kwargs={key: "{{ 7 * 7 }}"}))
            assert e.value.status == 400 and e.value.param == "chat_template_kwargs" and key in e.value.message
    finally:
        worker.close()


THOUGHT = r"<think>\n[a-z ]{4,30}\n</think>\n\nThe answer is (4|four)\."


@pytest.fixture(scope="module")
def server(shared_server):  # noqa: ANN001, ANN201
    # The default server's flags with a reasoning parser (the default model writes no <think> of its own:
    # a regex makes it).
    return shared_server(*DEFAULT_SERVER, "--reasoning-parser", "qwen3")


def test_chat_and_messages_set_the_reasoning_apart(server) -> None:  # noqa: ANN001
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    body = {"messages": ask, "max_tokens": 60, "temperature": 0, "guided_regex": THOUGHT}
    whole = web.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert whole["reasoning_content"].strip() and "<think>" not in whole["reasoning_content"]
    assert whole["content"] in ("The answer is 4.", "The answer is four.")
    reasoning, content = "", ""
    with web.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    plain = web.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ask, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"]  # no <think>: all content

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    model = web.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    fields = {"model": model, "messages": ask, "max_tokens": 60, "thinking": {"type": "enabled", "budget_tokens": 1024},
              "extra_body": {"temperature": 0, "structured_outputs": {"regex": THOUGHT}}}
    msg = client.messages.create(**fields)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (whole["reasoning_content"], whole["content"])
    with client.messages.stream(**fields) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        streamed = stream.get_final_message()
    assert deltas == {"thinking_delta", "text_delta"}
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == \
        [("thinking", whole["reasoning_content"]), ("text", whole["content"])]
