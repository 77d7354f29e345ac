"""gpt-oss's harmony format (tandem/serve/harmony.py) through the reply parser every streaming API uses:
a reply's analysis channel is its reasoning, its final channel (and a preamble addressed to no one) its
content, a message addressed to a function a tool call; the whole reply and its stream split anywhere
give the same pieces. The template picks the format; forced calls are refused with it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.sampling_params import ParamError
from tandem.serve.reasoning import OPENAI_GPTOSS, REASONING_FORMATS
from tandem.serve.reply_parser import ReplyParser
from tandem.serve.tool_calls.formats import OPENAI, format_for, template_knows_tools
from tandem.serve.tool_calls.plan import plan_tools
from tandem.serve.tool_calls.prompt import template_inputs

# gpt-oss's chat template as llama.cpp ships it (the set-up takes it from the llama-cpp-python sdist).
GPT_OSS_TEMPLATE = Path(sys.prefix) / "llama-cpp-convert" / "models" / "templates" / "openai-gpt-oss-120b.jinja"

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
REPLIES = [  # (reply, reasoning, content, [(name, arguments)])
    (f"{A}The user greets me.<|end|>{F}Hello! How can I help?<|return|>", "The user greets me.",
     "Hello! How can I help?", []),
    (f"{A}Need weather.<|end|>" + CALL.format("get_weather", '{"city": "Paris", "n": [1, {"a": "<|"}]}'),
     "Need weather.", "", [("get_weather", '{"city": "Paris", "n": [1, {"a": "<|"}]}')]),
    # Two calls, the recipient written before the channel in the second (both occur), a preamble first.
    (f"{A}Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
     + CALL.format("get_weather", '{"city": "Paris"}')
     + '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"city": "東京 ✓"}<|call|>',
     "Two lookups.", "Checking both.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "東京 ✓"}')]),
    # The recipient before the channel in the reply's first header, as the template writes calls.
    (' to=functions.get_time<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>', "", "",
     [("get_time", '{"city": "Oslo"}')]),
    ("Plain text, no channels < or |>.", "", "Plain text, no channels < or |>.", []),  # a model off the format
    ("tomorrow, maybe.", "", "tomorrow, maybe.", []),
    (f"{A}Cut short in the reas", "Cut short in the reas", "", []),  # max_tokens inside the analysis
    (f"{A}x<|end|>" + CALL.format("f", '{"a": "b').removesuffix("<|call|>"), "x", "", [("f", '{"a": "b')]),
    (f"{A}<|end|>{F}Only an answer, the end token not in the text", "", "Only an answer, the end token not in the text",
     []),
]


def parse(reply: str, cuts: list[int], tools: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    """The reply fed in pieces cut at `cuts`: (reasoning, content, [(name, arguments)])."""
    parser = ReplyParser(OPENAI if tools else None, OPENAI_GPTOSS)
    bounds = [0, *sorted(set(cuts)), len(reply)]
    reasoning, content, calls = "", "", {}
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        piece = parser.feed(reply[a:b], final=i == len(bounds) - 2)
        reasoning += piece.reasoning
        content += piece.delta.content
        for c in piece.delta.calls:
            if c.id is not None:
                assert c.index not in calls and c.id.startswith("call_") and c.name
                calls[c.index] = [c.name, c.arguments]
            else:
                calls[c.index][1] += c.arguments  # arguments only after the call's id and name
    assert parser.num_calls == len(calls)
    return reasoning, content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), REPLIES)
def test_a_reply_and_its_stream_parse_the_same_at_every_step(reply: str, reasoning: str, content: str,
                                                             calls: list[tuple[str, str]]) -> None:
    assert parse(reply, []) == (reasoning, content, calls)
    for step in range(1, len(reply)):
        assert parse(reply, list(range(step, len(reply), step))) == (reasoning, content, calls), step


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), REPLIES)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_split_points_parse_as_the_whole(reply: str, reasoning: str, content: str,
                                                calls: list[tuple[str, str]], data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(1, max(len(reply) - 1, 1)), max_size=12))
    assert parse(reply, cuts) == (reasoning, content, calls)


def test_without_tools_a_call_is_content_and_the_reasoning_still_apart() -> None:
    reply = f"{A}think<|end|>" + CALL.format("f", '{"x": 1}')
    assert parse(reply, [7, 30], tools=False) == ("think", '{"x": 1}', [])


def test_the_template_and_the_flags_pick_harmony() -> None:
    template = "{{- '<|start|>assistant<|channel|>final<|message|>' }}{% if tools %}namespace functions{% endif %}"
    assert format_for(template) is OPENAI and format_for(None, "openai") is OPENAI
    assert REASONING_FORMATS["openai_gptoss"] is OPENAI_GPTOSS
    tool = {"name": "f", "parameters": {"type": "object"}}
    assert plan_tools(OPENAI, [tool], "auto", True).parse
    for forced in ("required", {"name": "f"}):
        with pytest.raises(ParamError, match="harmony"):
            plan_tools(OPENAI, [tool], forced, True)


@pytest.mark.skipif(not GPT_OSS_TEMPLATE.exists() and not os.environ.get("CI"),
                    reason="gpt-oss's template: run scripts/setup.sh test")
def test_gpt_oss_template_renders_the_tools_and_a_call_round_trip_as_the_parser_reads_them() -> None:
    """The server's path for a chat with tools (template_inputs, then transformers' renderer) on gpt-oss's
    own template: the tools as a TypeScript namespace, the earlier call as a harmony message addressed
    to the function, its result from the function, and the prompt left for the assistant to write; the
    call as rendered parses back to the same name and arguments."""
    from tandem.model_path import default_model_path
    from tandem.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    tokenizer.chat_template = GPT_OSS_TEMPLATE.read_text()
    assert format_for(tokenizer.chat_template) is OPENAI and template_knows_tools(tokenizer.chat_template)
    weather = {"name": "get_weather", "description": "The weather now in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    messages, tools = template_inputs(chat, [weather], OPENAI, native=True)
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "namespace functions {" in prompt and "type get_weather = " in prompt
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    assert call in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in prompt
    assert prompt.endswith("<|start|>assistant")
    assert parse(call.removeprefix("<|start|>assistant"), []) == ("", "", [("get_weather", '{"city": "Paris"}')])
