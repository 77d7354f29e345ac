"""OpenAI's Responses API through the openai SDK against the default server: a response and its stream
give the chat API's greedy text; a follow-up by previous_response_id appends only its new input to the
stored conversation's tokens (its history reported as cached) and says what the full history says;
function tools round-trip; retrieve, input_items and delete; and errors are OpenAI-shaped 4xx."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from conftest import DEFAULT_SERVER
from server_utils import web

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
INSTRUCTIONS = "You are a terse assistant."


def text_of(response) -> str:  # noqa: ANN001
    return "".join(p.text for o in response.output if o.type == "message" for p in o.content)


@pytest.fixture(scope="module")
def server(shared_server):  # noqa: ANN001, ANN201
    return shared_server(*DEFAULT_SERVER)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_a_response_its_stream_and_a_follow_up_that_sends_only_its_new_input(server, client) -> None:  # noqa: ANN001
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, instructions=INSTRUCTIONS, input="Name a colour of the rainbow.",
                                    max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=30, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour of the rainbow."}])
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == chat.choices[0].message.content and first.output_text
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    with client.responses.stream(model=model, instructions=INSTRUCTIONS, input="Name a colour of the rainbow.",
                                 max_output_tokens=30, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    streamed = events[-1].response  # completed or incomplete (the SDK's get_final_response takes only the first)
    assert text_of(streamed) == first.output_text and streamed.usage.output_tokens == first.usage.output_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{first.status}"
    assert "response.output_text.delta" in kinds and kinds.count("response.output_item.added") == 1

    # The follow-up: its history's tokens are the stored ones, all cached; the reply is what the whole
    # history sent as chat gives (SmolLM2's template renders the history as it was generated).
    ask = "And another one?"
    second = client.responses.create(model=model, instructions=INSTRUCTIONS, input=ask, max_output_tokens=30,
                                     temperature=0, previous_response_id=first.id)
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= history - 16  # whole blocks of 16 cached
    assert second.usage.input_tokens > history
    full = client.chat.completions.create(model=model, max_tokens=30, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour of the rainbow."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": ask}])
    assert second.output_text == full.choices[0].message.content
    assert second.usage.input_tokens == full.usage.prompt_tokens  # the same tokens as the history rendered whole

    # Stored: retrieved, its input items listed, deleted; then gone.
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items] == \
        [("message", "user", "input_text", ask)]
    deleted = web.delete(f"{server.url}/v1/responses/{second.id}").json()
    assert deleted == {"id": second.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_tools_round_trip(server, client) -> None:  # noqa: ANN001
    model = client.models.list().data[0].id
    ask = "What is the weather in Paris?"
    forced = client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=80, temperature=0)
    calls = [o for o in forced.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    with client.responses.stream(model=model, input=ask, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=80, temperature=0) as stream:
        events = list(stream)
    kinds = {event.type for event in events}
    streamed = events[-1].response
    assert [(o.name, o.arguments) for o in streamed.output if o.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    assert "response.function_call_arguments.delta" in kinds
    # The results go back by previous_response_id, as the Agents SDK sends them.
    after = client.responses.create(model=model, previous_response_id=forced.id, tools=[WEATHER],
                                    input=[{"type": "function_call_output", "call_id": c.call_id,
                                            "output": "21 C, sunny"} for c in calls],
                                    max_output_tokens=20, temperature=0)
    assert after.status in ("completed", "incomplete")
    assert after.usage.input_tokens_details.cached_tokens >= forced.usage.input_tokens - 16


def test_structured_output_and_errors(server, client) -> None:  # noqa: ANN001
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    shaped = client.responses.create(model=model, input="Pick a colour.", max_output_tokens=30, text={
        "format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    for body, param in (({"input": []}, "input"), ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input"),
                        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
                        # A call's arguments sent back must be a JSON object's text (schemathesis found a 500).
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "user"},
                                    {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, "input"),
                        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text")):
        r = web.post(f"{server.url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert web.get(f"{server.url}/v1/responses/resp_nope").status_code == 404
    assert web.delete(f"{server.url}/v1/responses/resp_nope").status_code == 404


def test_a_stored_conversation_keeps_its_kv_under_pressure_and_gives_it_back(shared_server) -> None:  # noqa: ANN001
    # The default server's flags with a pool of 960 tokens (in blocks: the same on every machine,
    # whatever the default dtype), so that a few other prompts fill it, and room for one stored response.
    server = shared_server(*DEFAULT_SERVER, "--num-blocks", "60", "--max-stored-responses", "1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, instructions=INSTRUCTIONS * 8, input="Name a colour.",
                                    max_output_tokens=24, temperature=0)
    history = first.usage.input_tokens + first.usage.output_tokens
    for i in range(4):  # other traffic: unique prompts, about 1.5 pools' worth in all
        client.completions.create(model=model, prompt=f"{i} " + "lorem ipsum dolor sit amet " * 60, max_tokens=1)
    second = client.responses.create(model=model, instructions=INSTRUCTIONS * 8, input="Another?",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= history - 16, (history, second.usage)
    # Storing the second pushed the first out of the store, and its retained KV with it: once the
    # second is deleted too, no block is held.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert wait_for(lambda: server.metric("kv_cache_used_blocks") > 0)
    client.responses.delete(second.id)
    assert wait_for(lambda: server.metric("kv_cache_used_blocks") == 0)


def wait_for(check, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False
