"""Hostile request bodies against a live server: each gets the right 4xx with an OpenAI-shaped body
and a request id, and afterwards the server still serves a normal completion."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from conftest import FP32_SERVER
from fastapi import FastAPI
from fastapi.testclient import TestClient
from server_utils import Server, running_server, web

from tandem.serve.errors import bad_request, install_error_handlers
from tandem.serve.middleware import RequestIdMiddleware

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
# Jinja's sandbox refuses range() over 100,000 items, so the brief's range(10**6) fails at once;
# 10**5 squared is what actually runs for hours.
FREEZE = "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def server(shared_server) -> Server:  # noqa: ANN001 (the session's float32 server: bad bodies change nothing)
    return shared_server(*FP32_SERVER)


def assert_error(r: httpx.Response, status: int, param: str | None = None, says: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert len(r.headers["x-request-id"]) == 32
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err
    return err


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"prompt": "hi", "temperature": 3}, "temperature", None),
    ({"prompt": "hi", "top_p": 0}, "top_p", None),
    ({"prompt": "hi", "top_k": 10**6}, "top_k", "vocabulary size"),
    ({"prompt": "hi", "top_k": -2}, "top_k", None),
    ({"prompt": "hi", "seed": -1}, "seed", None),
    ({"prompt": "hi", "seed": 2**63}, "seed", None),
    ({"prompt": "hi", "seed": 10**30}, "seed", None),
    ({"prompt": "hi", "n": 0}, "n", None),
    ({"prompt": "hi", "n": 10**6}, "n", None),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", None),
    ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": 100_000}, "prompt", "maximum context length"),
    ({"prompt": "hi", "min_tokens": 100_000, "max_tokens": None}, "min_tokens", "min_tokens"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", None),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
    ({"prompt": "hi", "priority": 2**31}, "priority", None),
    ({"prompt": "hi", "timeout": 0}, "timeout", None),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", "[0, 49152)"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", None),
    ({"prompt": [49152]}, "prompt", "token ids must be in"),
    ({"prompt": [10**40]}, "prompt", None),
    ({"prompt": [-1]}, "prompt", None),
    ({"prompt": [1.0, 2.0]}, "prompt", None),
    ({"prompt": [True]}, "prompt", None),
    ({"prompt": [[[1]]]}, "prompt", None),
    ({"prompt": [[1], []]}, "prompt", "empty"),
    ({"prompt": ["a" * 600_000, "b" * 600_000]}, "prompt", "--max-prompt-chars"),
])
def test_out_of_range_completion_fields(server: Server, body: dict, param: str, says: str | None) -> None:
    assert_error(web.post(f"{server.url}/v1/completions", json=body, timeout=30), 400, param, says)


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hi", "frequency_penalty": -Infinity}', "frequency_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty"),
    (b'{"prompt": "hi", "timeout": NaN}', "timeout"),
])
def test_non_finite_numbers(server: Server, raw: bytes, param: str) -> None:
    # Python's json reads NaN and Infinity, so they arrive as floats.
    r = web.post(f"{server.url}/v1/completions", content=raw, headers=JSON, timeout=30)
    assert_error(r, 400, param, "finite")


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "a\\udfffb"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates(server: Server, path: str, raw: bytes, param: str) -> None:
    assert_error(web.post(f"{server.url}{path}", content=raw, headers=JSON, timeout=30), 400, param,
                 "cannot be encoded as UTF-8")


@pytest.mark.parametrize(("raw", "headers", "says"), [
    (b'{"prompt": "\xff\xfe caf\xe9"}', JSON, "not valid UTF-8"),
    (b"{not json", JSON, "not valid JSON"),
    (b"[1, 2, 3]", JSON, "JSON object"),
    (b'"a string"', JSON, "JSON object"),
    (b"5", JSON, "JSON object"),
    (b"null", JSON, "JSON object"),
    (b"", JSON, "JSON object"),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}, "Content-Type"),
    (b'{"prompt": "hi"}', {}, "Content-Type"),
    (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, "Content-Type"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, "nested too deeply"),
    (b'{"prompt": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}", JSON, "prompt must be"),
])
def test_unparseable_bodies(server: Server, raw: bytes, headers: dict, says: str) -> None:
    assert_error(web.post(f"{server.url}/v1/completions", content=raw, headers=headers, timeout=30), 400,
                 says=says)


def test_token_ids_outside_the_vocabulary_on_detokenize(server: Server) -> None:
    for tokens in ([10**6], [-1], [1.5], [True]):
        assert_error(web.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30), 400, "tokens")


def test_huge_bodies_get_413(server: Server) -> None:
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    assert_error(web.post(f"{server.url}/v1/completions", content=big, headers=JSON, timeout=60), 413,
                 says="limit")

    def chunks():  # noqa: ANN202 (no Content-Length: the server must count)
        yield b'{"prompt": "'
        for _ in range(90):
            yield b"a" * (100 << 10)
        yield b'"}'

    assert_error(web.post(f"{server.url}/v1/completions", content=chunks(), headers=JSON, timeout=60), 413)


def test_unknown_routes_and_wrong_methods(server: Server) -> None:
    assert_error(web.get(f"{server.url}/v1/nope"), 404, says="/v1/nope")
    assert_error(web.post(f"{server.url}/v2/completions", json={}), 404)
    r = assert_error(web.get(f"{server.url}/v1/completions"), 405, says="POST")
    assert "POST" in r["message"]
    assert_error(web.delete(f"{server.url}/health"), 405)


def test_health_is_json(server: Server) -> None:
    r = web.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "reasons": []} and r.headers["x-request-id"]


def test_a_request_chat_template_is_refused_by_default(server: Server) -> None:
    r = web.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "chat_template": FREEZE}, timeout=30)
    assert_error(r, 400, "chat_template", "--trust-request-chat-template")


def test_tokenization_runs_off_the_event_loop(server: Server) -> None:
    """While a prompt near the character limit is tokenized (most of a second), /health still answers."""

    async def go() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def tokenize() -> float:
                r = await c.post("/tokenize", json={"prompt": "hello world, here we go. " * 36_000})
                assert r.status_code == 200, r.text
                return time.monotonic()

            async def health() -> float:
                await asyncio.sleep(0.1)
                assert (await c.get("/health")).status_code == 200
                return time.monotonic()

            return await asyncio.gather(tokenize(), health())

    tokenized, healthy = asyncio.run(go())
    assert healthy < tokenized


def test_the_server_still_serves_after_all_that(server: Server) -> None:
    r = web.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                 timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_trusted_chat_templates_render_within_a_time_and_size_budget() -> None:
    with running_server(*FP32_SERVER, "--trust-request-chat-template") as s:
        async def go() -> tuple[httpx.Response, float, httpx.Response, float]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                async def timed(path: str, body: dict) -> tuple[httpx.Response, float]:
                    r = await c.post(path, json=body)
                    return r, time.monotonic()

                start = time.monotonic()
                (evil, t_evil), (normal, t_normal) = await asyncio.gather(
                    timed("/v1/chat/completions", {"messages": HI, "chat_template": FREEZE, "max_tokens": 2}),
                    timed("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}))
                return evil, t_evil - start, normal, t_normal - start

        evil, evil_s, normal, normal_s = asyncio.run(go())
        assert_error(evil, 400, "chat_template", "more than 2 s")
        assert evil_s < 10  # 2 s of budget, plus the renderer's start-up if it was still importing
        assert normal.status_code == 200 and normal_s < evil_s  # the server was not frozen meanwhile

        chat = f"{s.url}/v1/chat/completions"
        assert_error(web.post(chat, json={"messages": HI, "chat_template": "{{ 'a' * 10**7 }}"}, timeout=30),
                     400, "chat_template", "characters")
        assert_error(web.post(chat, json={"messages": HI, "chat_template": "{% for i in range(10**6) %}"
                                            "{% endfor %}"}, timeout=30), 400, "chat_template", "Range too big")
        assert_error(web.post(chat, json={"messages": HI, "chat_template": "{{ ''.__class__.__mro__ }}"}, timeout=30),
                     400, "chat_template", "unsafe")
        # The killed renderer was replaced: a sane template renders (and is what the model sees).
        template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        r = web.post(f"{s.url}/tokenize", json={"messages": HI}, timeout=30)
        ok = web.post(chat, json={"messages": HI, "chat_template": template, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == 1 < r.json()["count"]  # "hi" alone, not the model's template


def test_one_log_line_per_error_and_a_500_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    @app.get("/bad")
    async def bad() -> None:
        raise bad_request("nope", "x")

    with TestClient(app) as client, caplog.at_level(logging.INFO, logger="tandem.serve.api"):
        r = client.get("/boom")
        assert_error(r, 500, says="RuntimeError: kaput")
        lines = [rec for rec in caplog.records if rec.name == "tandem.serve.api"]
        assert len(lines) == 1 and lines[0].levelno == logging.ERROR and lines[0].exc_info is None
        assert r.headers["x-request-id"] in lines[0].getMessage() and "kaput" in lines[0].getMessage()

        caplog.clear()
        r = client.get("/bad")
        assert_error(r, 400, "x", "nope")
        lines = [rec for rec in caplog.records if rec.name == "tandem.serve.api"]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert r.headers["x-request-id"] in lines[0].getMessage()

    with TestClient(app) as client, caplog.at_level(logging.DEBUG, logger="tandem.serve.api"):
        caplog.clear()
        client.get("/boom")
        assert any(rec.exc_info for rec in caplog.records)  # the traceback, at DEBUG only
