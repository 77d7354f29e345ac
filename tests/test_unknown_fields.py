"""Unknown request fields: which ones a body's models find (nested ones too, each once), the one
warning per request and its header, the 400 of --reject-unknown-fields on every JSON POST endpoint,
and that an ignored field changes nothing the model is shown. The same over a live server:
tests/test_server.py::test_unknown_fields_are_ignored_and_named."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from tandem.serve.api import build_app
from tandem.serve.errors import APIError
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest, unknown_fields
from tandem.serve.settings import ServerSettings
from tandem.serve.unknown_fields import MAX_NAMED, UnknownFields

HI = [{"role": "user", "content": "hi"}]
FUNCTION = {"name": "f", "description": "d", "parameters": {"type": "object", "x-own": 1}}


def test_unknown_fields_are_found_at_any_depth_and_named_once() -> None:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}], "w": 1},
                     {"role": "user", "content": "b", "w": 2}],
        "top": 1, "stream_options": {"include_usage": True, "extra": 1},
        "tools": [{"type": "function", "function": FUNCTION | {"examples": []}, "cache": 1}],
        "tool_choice": {"type": "function", "function": {"name": "f", "why": 1}},
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"made_up": 1}, "schema_": 1}},
    })
    found = unknown_fields(body)
    assert found[0] == "top"  # the top level's first: a 400's param
    assert sorted(found) == sorted(["top", "messages[].w", "messages[].content[].cache_control",
                                    "stream_options.extra", "tools[].cache", "tools[].function.examples",
                                    "tool_choice.function.why", "response_format.json_schema.schema_"])
    # Known fields, used or not (user, suffix, parallel_tool_calls), and free-form objects are not unknown.
    known = CompletionRequest.model_validate({"prompt": "x", "user": "u", "suffix": "s", "logit_bias": {"1": 2},
                                              "structured_outputs": {"json": {"made_up": 1}}})
    assert unknown_fields(known) == []


def test_an_ignored_field_is_not_shown_to_the_template() -> None:
    body = ChatCompletionRequest.model_validate({"messages": HI, "tools": [
        {"type": "function", "function": FUNCTION | {"examples": [], "strict": True}}]})
    assert body.function_defs() == [FUNCTION]


def test_one_warning_per_request_and_the_header(caplog: pytest.LogCaptureFixture) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "a": 1, "b\n\u00e9": 2, "stream_options": {"c": 3}})
    with caplog.at_level(logging.WARNING, logger="tandem.serve.api"):
        headers = UnknownFields().check(body, "rid1")
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "rid1" in record.getMessage()
    # The client's names, escaped: a newline cannot start a forged log line, nor break the header.
    assert record.getMessage().endswith('ignored unknown fields: a, "b\\n\\u00e9", stream_options.c')
    assert headers == {"X-Ignored-Fields": 'a, "b\\n\\u00e9", stream_options.c'}
    caplog.clear()
    assert UnknownFields().check(CompletionRequest.model_validate({"prompt": "x"}), "rid2") == {}
    assert not caplog.records
    many = CompletionRequest.model_validate({"prompt": "x"} | {f"k{i}" + "z" * 100: i for i in range(40)})
    with caplog.at_level(logging.WARNING, logger="tandem.serve.api"):
        header = UnknownFields().check(many, "rid3")["X-Ignored-Fields"]
    assert len(header.split(", ")) == MAX_NAMED and len(header) < 1200
    assert caplog.records[0].getMessage().endswith(f"(and {40 - MAX_NAMED} more)")


@pytest.mark.parametrize("name", ["x ", " x", "", "a\nb", "a\r\nX-Forged: 1", "\t", "\x00", "\x7f", "\u00e9",
                                  "\U0001f600", "a, b", '"q"', "\u2028", "\u00e9" * 40])
def test_a_name_that_could_break_the_header_is_quoted(name: str) -> None:
    """h11 refuses a header value with edge spaces, control or non-ASCII characters: the response would
    never be sent (the server logs a 500). Such a name is a JSON string in ASCII; it decodes back to
    the name (cut at MAX_NAME_CHARS characters of its escaped form, never inside an escape)."""
    h11 = pytest.importorskip("h11")
    body = CompletionRequest.model_validate({"prompt": "x", "plain": 2, name: 1})  # last: its edge is the header's
    header = UnknownFields().check(body, "rid")["X-Ignored-Fields"]
    h11.Response(status_code=200, headers=[("X-Ignored-Fields", header)])  # raises on an invalid value
    plain, quoted = header.split(", ", 1)
    assert plain == "plain" and quoted.isascii() and quoted.isprintable()
    shown = json.loads(quoted)
    assert name.startswith(shown) and (shown == name or len(quoted) > 60)


def test_reject_unknown_fields_is_a_400_naming_them() -> None:
    with pytest.raises(APIError) as e:
        UnknownFields(reject=True).check(CompletionRequest.model_validate({"prompt": "x", "zz": 1}), "rid")
    assert (e.value.status, e.value.param) == (400, "zz") and "zz" in e.value.message
    # The check comes first, so an app whose engine never starts answers it.
    app = build_app(None, ServerSettings(reject_unknown_fields=True), None, engine=object())  # type: ignore[arg-type]
    client = TestClient(app)
    for path, body, param, names in (
            ("/v1/completions", {"prompt": "hi", "stream": True, "best_of_n": 2, "stream_options": {"x": 1}},
             "best_of_n", "best_of_n, stream_options.x"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "w": 1}]}, "messages[].w",
             "messages[].w"),
            ("/tokenize", {"prompt": "hi", "q": 1}, "q", "q"),
            ("/detokenize", {"tokens": [1], "q": 1}, "q", "q")):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"unknown fields: {names} " in error["message"], error
        assert "x-ignored-fields" not in r.headers
