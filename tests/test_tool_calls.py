"""Tool calling: the parser (a reply and its stream agree however the text is split; what is not a
call stays content), forced calls (every sampled call names a tool and its arguments validate
against that tool's schema), the prompt (tools for templates that know them, and for SmolLM2's,
which does not), and the API through the official openai client, streaming and not, for auto,
required, a named function and none."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import DEFAULT_SERVER
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import web

from tandem import SamplingParams
from tandem.sampling_params import StructuredOutputs
from tandem.serve.tool_calls.formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI4_MINI_JSON,
    format_for,
    template_knows_tools,
)
from tandem.serve.tool_calls.parser import Delta, ToolCallParser, parse_reply
from tandem.serve.tool_calls.plan import forced_calls_grammar, plan_tools
from tandem.serve.tool_calls.prompt import template_inputs

WEATHER = {"name": "get_weather", "description": "The weather now in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The local time in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
    "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]

REPLIES = [  # (format, reply, content, [(name, arguments)])
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "To\\"kyo"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'),
                       ("get_time", '{"city": "To\\"kyo"}')]),
    (HERMES, "No <tool here>, just < text.", "No <tool here>, just < text.", []),
    (HERMES, '<tool_call>\n{"arguments": {"q": 1}, "name": "late"}\n</tool_call>', None, [("late", '{"q": 1}')]),
    (HERMES, "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    (HERMES, '<tool_call>\n{"name": "cut", "arguments": {"a": "b', None, [("cut", '{"a": "b')]),  # max_tokens hit
    (HERMES, '<tool_call>{"name": "n", "arguments": 7}</tool_call>', None, [("n", "7")]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"x": 1}'), ("g", "{}")]),
    (LLAMA3_JSON, "The answer is 4.", "The answer is 4.", []),
    (LLAMA3_JSON, '{"not": "a call"}', '{"not": "a call"}', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, {"y": "]"}]}}, {"name": "g", "arguments": {}}]',
     None, [("f", '{"x": [1, {"y": "]"}]}'), ("g", "{}")]),
    (MISTRAL, ' [TOOL_CALLS] [{"arguments": {"q": 1}, "name": "late"}]', None, [("late", '{"q": 1}')]),
    (MISTRAL, '[TOOL_CALLS][{"name": "cut", "arguments": {"a": "b', None, [("cut", '{"a": "b')]),  # max_tokens hit
    (MISTRAL, "The answer is [4].", "The answer is [4].", []),
    (MISTRAL, '[{"name": "f", "arguments": {}}]', '[{"name": "f", "arguments": {}}]', []),  # no marker: content
    (MISTRAL, "[TOOL_CALLS] not an array", "[TOOL_CALLS] not an array", []),
    (PHI4_MINI_JSON, 'functools[{"name": "f", "arguments": {"s": "functools["}}, {"name": "g", "arguments": {}}]', None,
     [("f", '{"s": "functools["}'), ("g", "{}")]),
    (PHI4_MINI_JSON, "functools are handy.", "functools are handy.", []),
]


def streamed(fmt, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:  # noqa: ANN001
    return cut_at(fmt, text, list(range(step, len(text), step)))


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), REPLIES)
def test_a_reply_and_its_stream_parse_the_same_however_it_is_split(fmt, reply, content, calls) -> None:  # noqa: ANN001
    parsed = parse_reply(fmt, reply)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for step in range(1, len(reply) + 1):
        assert streamed(fmt, reply, step) == (content or "", calls), step


def cut_at(fmt, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:  # noqa: ANN001
    parser, out = ToolCallParser(fmt), Delta()
    bounds = sorted(set(cuts))
    for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True):
        out.extend(parser.feed(text[a:b]))
    out.extend(parser.finish())
    calls: dict[int, list[str]] = {}
    for d in out.calls:
        if d.id is not None:
            assert d.index not in calls and d.id.startswith("call_") and d.name
            calls[d.index] = [d.name, d.arguments]
        else:
            calls[d.index][1] += d.arguments  # arguments only after the call's id and name
    return out.content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), [
    *REPLIES, (HERMES, 'Voilà ✓ 东京\n<tool_call>\n{"name": "f", "arguments": {"city": "東京 ✓"}}\n</tool_call>',
               "Voilà ✓ 东京", [("f", '{"city": "東京 ✓"}')])])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_format_parses_the_same_at_random_split_points(fmt, reply, content, calls, data) -> None:  # noqa: ANN001
    # Any number of cuts anywhere, several in a row included (a detokenizer's deltas are uneven).
    cuts = data.draw(st.lists(st.integers(1, max(len(reply) - 1, 1)), max_size=12))
    assert cut_at(fmt, reply, cuts) == (content or "", calls)


def test_the_format_follows_the_template_and_the_flag() -> None:
    assert format_for(None) is HERMES and not template_knows_tools(None)
    assert format_for("{% if tools %}...<tool_call>{% endif %}") is HERMES
    assert format_for("{{ '<|python_tag|>' }}{% for t in tools %}{% endfor %}") is LLAMA3_JSON
    assert format_for(None, "llama3_json") is LLAMA3_JSON
    assert format_for("{%- if tools %}[AVAILABLE_TOOLS]...{%- endif %}{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert format_for(None, "mistral") is MISTRAL
    assert format_for("{% if tools %}... functools[{{ tools | tojson }}]{% endif %}") is PHI4_MINI_JSON
    with pytest.raises(ValueError, match="unknown tool call parser"):
        format_for(None, "pythonic")


def test_the_prompt_shows_the_tools_and_the_history_in_the_format() -> None:
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]},
        {"role": "tool", "content": "21 C, sunny", "tool_call_id": "call_1"}]
    messages, native = template_inputs(history, TOOLS, HERMES, native=False)
    assert native is None and messages[0]["role"] == "system"
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                          '{"city": "Paris", "unit": "C"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"}
    messages, native = template_inputs(history, TOOLS, HERMES, native=True)
    assert native == [{"type": "function", "function": t} for t in TOOLS]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": {"city": "Paris", "unit": "C"}}
    assert messages[2]["tool_call_id"] == "call_1"


def test_tool_choice_is_checked() -> None:
    assert plan_tools(HERMES, None, None, True) is None
    none = plan_tools(HERMES, TOOLS, "none", True)  # as vLLM: the tools are shown, no call is made or parsed
    assert none.prompt_tools == TOOLS and not none.parse and none.grammar is None
    auto = plan_tools(HERMES, TOOLS, None, True)
    assert auto.parse and auto.grammar is None and auto.prompt_tools == TOOLS
    for tools, choice, param in ((None, "required", "tool_choice"), (TOOLS, {"name": "nope"}, "tool_choice"),
                                 ([WEATHER, WEATHER], "auto", "tools")):
        with pytest.raises(ValueError) as e:
            plan_tools(HERMES, tools, choice, True)
        assert e.value.param == param  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=["hermes", "llama3_json", "mistral"])
def test_forced_calls_name_a_tool_and_their_arguments_validate(llm_fp32, fmt) -> None:  # noqa: ANN001
    """tool_choice required: over many seeds, the reply is a call and nothing else, in the format's
    syntax, naming one of the tools with arguments that its schema accepts. (With parallel calls a
    135M model sampled at temperature 1 may keep calling until max_tokens; one call must end.)"""
    so = StructuredOutputs("grammar", forced_calls_grammar(fmt, TOOLS, parallel=False))
    messages, _ = template_inputs(ASK, TOOLS, fmt, native=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured=so) for s in range(8)]
    for out in llm_fp32.chat([messages] * len(params), params):
        reply = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", reply
        parsed = parse_reply(fmt, reply)
        assert parsed.content is None and parsed.calls, reply
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI_JSON],
                         ids=["hermes", "llama3_json", "mistral", "phi4_mini_json"])
def test_the_forced_grammar_takes_parallel_calls_only_when_asked(llm_fp32, fmt) -> None:  # noqa: ANN001
    from tandem.engine.grammars import Grammars
    from tandem.serve.tool_calls.prompt import call_text

    tokenizer = llm_fp32.get_tokenizer()
    grammars = Grammars(tokenizer, 49152)

    def reply(*calls: str) -> str:  # the calls as the format's reply writes them
        text = fmt.separator.join(calls)
        return f"{fmt.prefix}[{text}]" if fmt.array else text

    one = reply(call_text(fmt, "get_time", {"city": "Oslo"}))
    two = reply(call_text(fmt, "get_time", {"city": "Oslo"}),
                call_text(fmt, "get_weather", {"city": "Rome", "unit": "F"}))

    def accepts(text: str, parallel: bool) -> bool:
        m = grammars.matcher(StructuredOutputs("grammar", forced_calls_grammar(fmt, TOOLS, parallel)))
        return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts(one, False) and accepts(one, True) and accepts(two, True) and not accepts(two, False)
    assert not accepts(reply(call_text(fmt, "get_time", {"city": 5})), True)  # the schema holds
    assert not accepts(reply(call_text(fmt, "get_date", {})), True)  # only the tools given


def test_a_named_function_is_the_only_call(llm_fp32) -> None:  # noqa: ANN001
    so = StructuredOutputs("grammar", forced_calls_grammar(HERMES, [TIME], parallel=False))
    messages, _ = template_inputs(ASK, TOOLS, HERMES, native=False)
    outs = llm_fp32.chat([messages] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured=so)
                                          for s in range(4)])
    for out in outs:
        calls = parse_reply(HERMES, out.outputs[0].text).calls
        assert [c.name for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0].arguments), TIME["parameters"])


def test_the_openai_client_round_trip(shared_server) -> None:  # noqa: ANN001
    tools = [{"type": "function", "function": t} for t in TOOLS]
    server = shared_server(*DEFAULT_SERVER)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id

    def ask(stream: bool, **fields: object):  # noqa: ANN202
        return client.chat.completions.create(model=model, messages=ASK, tools=tools, temperature=0,
                                              max_tokens=120, stream=stream, **fields)

    def gathered(stream) -> tuple[str | None, list[tuple[str, str]], str]:  # noqa: ANN001
        content, calls, finish = "", {}, None
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    if tc.id is not None:
                        calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                    else:
                        calls[tc.index][1] += tc.function.arguments
                finish = choice.finish_reason or finish
        return content or None, [tuple(calls[i]) for i in sorted(calls)], finish

    # required: greedy, so the stream must carry exactly the response's calls
    whole = ask(False, tool_choice="required").choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert gathered(ask(True, tool_choice="required")) == (None, calls, "tool_calls")

    # a named function
    named = ask(False, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]

    # auto: what the model writes is parsed (held to a call here by a regex, so that the 135M
    # model's choice does not decide the test), content first
    regex = (r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
             r'"unit": "C"\}\}\n</tool_call>')
    auto = ask(False, extra_body={"guided_regex": regex}).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Let me look."
    [call] = auto.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "C"
    assert gathered(ask(True, extra_body={"guided_regex": regex})) == (
        "Let me look.", [("get_weather", call.function.arguments)], "tool_calls")
    plain = ask(False, extra_body={"guided_choice": ["It is sunny."]}).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("It is sunny.", None, "stop")

    # none: the tools in the prompt (auto's prompt, token for token), but a call is content, not parsed
    none = ask(False, tool_choice="none", extra_body={"guided_regex": regex})
    bare = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    assert none.choices[0].finish_reason == "stop"
    assert none.usage.prompt_tokens == ask(False).usage.prompt_tokens > bare.usage.prompt_tokens
    assert gathered(ask(True, tool_choice="none", extra_body={"guided_regex": regex})) == (
        none.choices[0].message.content, [], "stop")

    # the next turn: the call and its result go back in, and the prompt shows both
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    after = client.chat.completions.create(model=model, messages=turn, tools=tools, temperature=0, max_tokens=20)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shown = web.post(f"{server.url}/tokenize", json={"messages": turn}).json()["tokens"]
    prompt = web.post(f"{server.url}/detokenize", json={"tokens": shown}).json()["prompt"]
    assert "<tool_response>\n21 C and sunny\n</tool_response>" in prompt and call.function.arguments in prompt

    # bad requests are 400s that name the field
    for fields, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                          ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                          ({"tools": [], "tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                              "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
                            "tool_choice": "required"}, "tools")):
        r = web.post(f"{server.url}/v1/chat/completions", timeout=60,
                     json={"messages": ASK, "tools": tools, "max_tokens": 5} | fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    broken = [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{oops"}}]}]
    r = web.post(f"{server.url}/v1/chat/completions", json={"messages": broken, "max_tokens": 5}, timeout=60)
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"], r.text
    assert web.get(f"{server.url}/health").status_code == 200
