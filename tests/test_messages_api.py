"""Anthropic's Messages API through Anthropic's own SDK, against the default server: a message and its
stream give the chat API's greedy text, token counts and cached tokens agree, a forced tool call comes
back as tool_use blocks (streamed as input_json_delta) and its result goes back into the next turn,
stop sequences say which one stopped the reply, and every error is a 4xx in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from conftest import DEFAULT_SERVER
from server_utils import web

WEATHER = {"name": "get_weather", "description": "The weather now in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "You are a terse assistant."
GREEDY = {"temperature": 0}  # still Anthropic's field, but no longer the SDK's argument


@pytest.fixture(scope="module")
def server(shared_server):  # noqa: ANN001, ANN201
    return shared_server(*DEFAULT_SERVER)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:  # noqa: ANN001
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def model_of(server) -> str:  # noqa: ANN001
    return web.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def text_of(message) -> str:  # noqa: ANN001
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_and_its_stream_are_the_chat_apis_greedy_reply(server, client) -> None:  # noqa: ANN001
    model = model_of(server)
    ask = [{"role": "user", "content": "Name three colours of the rainbow."}]
    msg = client.messages.create(model=model, system=SYSTEM, messages=ask, max_tokens=40, extra_body=GREEDY)
    chat = web.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "system", "content": SYSTEM}, *ask], "max_tokens": 40,
        "temperature": 0}).json()
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert text_of(msg) == chat["choices"][0]["message"]["content"] and text_of(msg)
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    prompt_tokens = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt_tokens == chat["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=ask)
    assert counted.input_tokens == prompt_tokens
    # The chat request ran the same prompt just before: most of it is now a prefix-cache hit, as both say.
    again = client.messages.create(model=model, system=SYSTEM, messages=ask, max_tokens=40, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens > 0 and text_of(again) == text_of(msg)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt_tokens
    details = chat["usage"]["prompt_tokens_details"]
    assert 0 <= details["cached_tokens"] < chat["usage"]["prompt_tokens"]

    with client.messages.stream(model=model, system=SYSTEM, messages=ask, max_tokens=40, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(msg) and streamed.stop_reason == msg.stop_reason
    assert streamed.usage.output_tokens == msg.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_stop_sequences_say_which_one_stopped_the_reply(server, client) -> None:  # noqa: ANN001
    model = model_of(server)
    full = text_of(client.messages.create(model=model, messages=ASK, max_tokens=30, extra_body=GREEDY))
    word = next(w for w in full.split()[2:] if len(w) > 2)
    cut = client.messages.create(model=model, messages=ASK, max_tokens=30, extra_body=GREEDY,
                                 stop_sequences=["@@never@@", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert text_of(cut) == full[:full.index(word)]


def test_output_config_format_holds_the_reply_to_a_json_schema(server, client) -> None:  # noqa: ANN001
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
              "required": ["colour", "n"], "additionalProperties": False}
    msg = client.messages.create(model=model_of(server), messages=[{"role": "user", "content": "Pick a colour."}],
                                 max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(msg)), schema)


def test_a_tool_use_round_trip(server, client) -> None:  # noqa: ANN001
    model = model_of(server)

    def ask(stream: bool, messages: list, **fields: object):  # noqa: ANN202
        args = {"model": model, "messages": messages, "tools": [WEATHER], "max_tokens": 80, "extra_body": GREEDY}
        if not stream:
            return client.messages.create(**args, **fields)
        with client.messages.stream(**args, **fields) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            return s.get_final_message(), deltas

    forced = ask(False, ASK, tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use" and forced.content
    uses = [b for b in forced.content if b.type == "tool_use"]
    assert uses and all(b.id.startswith("toolu_") and b.name == "get_weather" for b in uses)
    for b in uses:
        jsonschema.validate(b.input, WEATHER["input_schema"])
    streamed, deltas = ask(True, ASK, tool_choice={"type": "any"})
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(b.type, b.name, b.input) for b in uses]
    assert streamed.stop_reason == "tool_use" and "input_json_delta" in deltas
    named = ask(False, ASK, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]

    # The call and its result go back in: the prompt grows by them, and the model answers.
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input"})
                                                    for b in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "21 C, sunny"}
                                         for b in uses]}]
    first = client.messages.count_tokens(model=model, messages=ASK, tools=[WEATHER]).input_tokens
    second = client.messages.count_tokens(model=model, messages=turn, tools=[WEATHER]).input_tokens
    assert second > first + 5
    after = ask(False, turn)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == second


def test_errors_are_4xx_in_anthropics_shape(server, client) -> None:  # noqa: ANN001
    model = model_of(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for body, says in (({"messages": ASK}, "max_tokens"),
                       ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
                       ({"messages": [], "max_tokens": 4}, "messages"),
                       ({"messages": ASK, "max_tokens": 4, "temperature": 1.5}, "temperature"),
                       ({"messages": [{"role": "user", "content": [image]}], "max_tokens": 4}, "image"),
                       ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                    "input": {}}]}], "max_tokens": 4}, "tool_use"),
                       ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"},
                         "tools": [WEATHER]}, "nope"),
                       ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
                       ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 64}},
                        "thinking")):
        r = web.post(f"{server.url}/v1/messages", json={"model": model} | body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", r.text
        assert says in error["error"]["message"], (body, r.text)
    r = web.post(f"{server.url}/v1/messages", content=b"{not json", timeout=60,
                 headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # The OpenAI routes keep OpenAI's shape.
    r = web.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert web.get(f"{server.url}/health").status_code == 200
