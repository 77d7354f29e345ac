"""The OpenAI-compatible server, exercised with the official `openai` client over real sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
import zmq
from server_utils import Server, children, cmdline, free_port, running_server, web

from tandem.engine.messages import KVEvents

pytestmark = pytest.mark.slow

# float32: greedy outputs are exact across batch shapes and cache hits (bf16 rounding differs by path).
SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "0.5", "--max-num-batched-tokens", "256")


KV_EVENTS_PORT = free_port()


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    with running_server(*SERVER_ARGS, "--kv-events-endpoint", f"tcp://127.0.0.1:{KV_EVENTS_PORT}") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def wait_idle(server: Server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("kv_cache_used_blocks") == 0 and server.metric("num_requests_running") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks still used: {server.metric('kv_cache_used_blocks')}")


def test_models_and_completion_usage(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list()
    name = models.data[0].id
    out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8, temperature=0)
    n_prompt = len(web.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"])
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    detok = web.post(f"{server.url}/detokenize", json={"tokens": [504, 3575]}).json()
    assert isinstance(detok["prompt"], str) and detok["prompt"]
    assert web.get(f"{server.url}/version").json()["version"]
    assert "/v1/completions" in web.get(f"{server.url}/openapi.json").json()["paths"]
    # The default model as stored: ~92 MiB of Q4_1 and Q8_0 blocks (513 dequantized to float32).
    weights = [line for line in web.get(f"{server.url}/metrics").text.splitlines()
               if line.startswith("tandem:model_weight_bytes{")]
    assert len(weights) == 1 and 'formats="gguf-Q4_1,gguf-Q8_0"' in weights[0]
    assert 80 * 2**20 < float(weights[0].rsplit(" ", 1)[1]) < 110 * 2**20
    assert server.metric("kv_cache_bytes_per_token") == 30 * 2 * 3 * 64 * 4  # layers, K+V, KV heads, dims, fp32


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs,
                                          max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=full.model, messages=msgs, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    prompt = "Once upon a time"
    plain = client.completions.create(model=full.model, prompt=prompt, max_tokens=25, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=full.model, prompt=prompt, max_tokens=25, temperature=0, stream=True))
    assert streamed == plain.choices[0].text


def test_completion_features(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=["Hello", "Goodbye"], max_tokens=5, temperature=0, n=2,
                                    echo=True, logprobs=2, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("Hello") and out.choices[2].text.startswith("Goodbye")
    # echo with logprobs scores the prompt too (OpenAI's legacy behaviour): "Hello" is one token, unscored.
    echoed = out.choices[0].logprobs
    assert echoed.tokens[0] == "Hello" and echoed.token_logprobs[0] is None and len(echoed.tokens) == 1 + 5
    assert all(len(top) == 2 for top in echoed.top_logprobs[1:])
    out = client.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                          max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text


def test_32_concurrent_streams(server: Server, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    prompts = [f"Write a sentence about the number {i}." for i in range(4)]
    expected = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                               max_tokens=24, temperature=0).choices[0].message.content
                for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        stream = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompts[i % 4]}], max_tokens=24, temperature=0,
            stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(all_())
    assert results == [expected[i % 4] for i in range(32)]
    wait_idle(server)


def test_disconnect_frees_blocks(server: Server, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    wait_idle(server)
    with web.stream("POST", f"{server.url}/v1/completions", json={
            "model": model, "prompt": "Tell me a very long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert server.metric("kv_cache_used_blocks") > 0
    wait_idle(server)  # the request was aborted and its blocks freed
    # Non-streaming: the client gives up (timeout) while the server is generating.
    with pytest.raises(httpx.ReadTimeout):
        web.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "Go on", "max_tokens": 3000,
                                                         "ignore_eos": True}, timeout=2)
    wait_idle(server)


@pytest.mark.parametrize(("body", "status", "param"), [
    ("{not json", 400, None),
    ({"prompt": 5, "max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "", "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [10**9], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "prompt"),
    ({"prompt": "hi " * 9000, "max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "logit_bias": {"1000000": 5}}, 400, "logit_bias"),  # outside the vocabulary
    ({"prompt": "hi", "logit_bias": {"12": 150}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"twelve": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-3": 1}}, 400, "logit_bias"),
])
def test_bad_completion_requests(server: Server, body, status, param) -> None:  # noqa: ANN001
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    r = web.post(f"{server.url}/v1/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    if param:
        assert err["param"] == param
    assert web.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(("body", "status"), [
    ({"messages": []}, 400),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"messages": "hello"}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404),
])
def test_bad_chat_requests(server: Server, client: openai.OpenAI, body, status) -> None:  # noqa: ANN001
    r = web.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status
    ok = client.chat.completions.create(model=client.models.list().data[0].id,
                                        messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_api_key_and_admission_control() -> None:
    with running_server(*SERVER_ARGS, "--api-key", "sekrit", "--api-key", "other", "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--metrics-require-api-key") as s:
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert web.get(f"{s.url}/v1/models").status_code == 401
        assert web.get(f"{s.url}/health").status_code == 200  # only what does work is guarded
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            assert web.post(f"{s.url}{path}", json=body).status_code == 401
            assert web.post(f"{s.url}{path}", json=body, headers={"authorization": "Bearer sekrit"}).status_code \
                == 200
        assert web.get(f"{s.url}/metrics").status_code == 401
        assert web.get(f"{s.url}/metrics", headers={"authorization": "Bearer sekrit"}).status_code == 200
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0)
        model = good.models.list().data[0].id
        assert good.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        # Anthropic's clients send the key as x-api-key, and read a refusal in Anthropic's shape.
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"
        reply = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0).messages.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.usage.output_tokens == 2
        # A stored response is its tenant's: another key can neither read, continue nor delete it.
        mine = good.responses.create(model=model, input="Hi", max_output_tokens=2)
        theirs = openai.OpenAI(base_url=f"{s.url}/v1", api_key="other", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.create(model=model, input="And?", previous_response_id=mine.id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.delete(mine.id)
        assert good.responses.retrieve(mine.id).id == mine.id

        async def burst() -> list[int]:
            async with httpx.AsyncClient(headers={"authorization": "Bearer sekrit"}, timeout=60) as c:
                rs = await asyncio.gather(*(c.post(f"{s.url}/v1/completions", json={
                    "model": model, "prompt": "Count slowly", "max_tokens": 40, "ignore_eos": True})
                    for _ in range(6)))
                for r in rs:
                    if r.status_code == 429:
                        assert r.headers["retry-after"] and r.json()["error"]["type"] == "RateLimitError"
                return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert 429 in codes and 200 in codes


def test_request_timeout_and_sigterm() -> None:
    s = Server([*SERVER_ARGS, "--request-timeout", "1"])
    try:
        s.wait_ready()
        r = web.post(f"{s.url}/v1/completions", json={"prompt": "Go", "max_tokens": 4000, "ignore_eos": True},
                     timeout=60)
        assert r.status_code == 408 and r.json()["error"]["type"] == "TimeoutError"
        aborted = [line for line in web.get(f"{s.url}/metrics").text.splitlines()
                   if line.startswith("tandem:request_success_total{") and 'finished_reason="abort"' in line]
        assert aborted and float(aborted[0].rsplit(" ", 1)[1]) == 1  # a timed-out request counts as aborted
        deadline = time.monotonic() + 10
        while s.metric("kv_cache_used_blocks") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.metric("kv_cache_used_blocks") == 0
    finally:
        code = s.stop(signal.SIGTERM)
    assert code == 0


def test_prefix_cache_metrics_and_kv_events(server: Server, client: openai.OpenAI) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{KV_EVENTS_PORT}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # let the subscription reach the publisher
    model = client.models.list().data[0].id
    system = "You are a meticulous assistant. " * 20  # well over one block of shared prefix
    hits_before = server.metric("prefix_cache_hits_total")
    for q in ("What is 2+2?", "What is 3+3?"):
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
    assert server.metric("prefix_cache_hits_total") - hits_before >= 16 * 5
    assert sub.poll(5000), "no KV events were published"
    msg = sub.recv_pyobj()
    assert isinstance(msg, KVEvents) and any(type(e).__name__ == "BlockStored" for e in msg.events)
    sub.close(linger=0)


def test_a_killed_engine_core_is_started_again() -> None:
    """kill -9 of the engine process: 503s and an unhealthy /health meanwhile, never a hang; a request
    waiting for its first token is sent again to the new core and succeeds."""
    with running_server(*SERVER_ARGS) as s:
        core = next(pid for pid in children(s.proc.pid) if b"--role\x00colocated" in cmdline(pid))
        waiting: dict[str, httpx.Response] = {}
        # A prompt of 1,500 tokens in 256-token steps: still prefilling, no output yet, when the core dies.
        thread = threading.Thread(target=lambda: waiting.update(r=web.post(
            f"{s.url}/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 3, "ignore_eos": True},
            timeout=240)))
        thread.start()
        time.sleep(0.5)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while web.get(f"{s.url}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        health = web.get(f"{s.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        r = web.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 180
        while web.get(f"{s.url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.3)
        r = web.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        thread.join(240)
        assert waiting["r"].status_code == 200 and waiting["r"].json()["usage"]["completion_tokens"] == 3


def test_logit_bias_forces_and_bans_tokens(server: Server) -> None:
    def complete(**extra: object) -> dict:
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 0} | extra
        r = web.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    token = web.post(f"{server.url}/detokenize", json={"tokens": [28]}, timeout=30).json()["prompt"]
    assert complete(logit_bias={"28": 100})["text"] == token * 4  # every token the biased one
    plain = complete()["logprobs"]["tokens"]
    first = web.post(f"{server.url}/tokenize", json={"prompt": plain[0], "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert len(first) == 1
    assert complete(logit_bias={str(first[0]): -100})["logprobs"]["tokens"][0] != plain[0]


@pytest.mark.parametrize(("bias", "says"), [
    ({"1_0": 1}, "'1_0'"),  # int() takes these four as token ids
    ({" 12 ": 1}, "' 12 '"),
    ({"\u0661\u0662": 1}, "'\u0661\u0662'"),  # Arabic-Indic 12
    ({"+12": 1}, "'+12'"),
    ({"12": True}, "True"),  # pydantic's lax float takes these two as 1.0 and 5.0
    ({"12": "5"}, "'5'"),
    ({"12": None}, "None"),
])
def test_logit_bias_keys_are_ascii_token_ids_and_values_numbers(server: Server, bias: dict, says: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        r = web.post(f"{server.url}{path}", json=body | {"logit_bias": bias}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"], err["type"]) == ("logit_bias", 400, "BadRequestError"), err
        what = "values must be numbers" if "12" in bias else "keys must be token ids written as ASCII digits"
        assert err["message"].startswith(f"logit_bias {what} (got {says}"), err
    ok = web.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": {"12": 5}},
                  timeout=30)
    assert ok.status_code == 200, ok.text


def test_unknown_fields_are_ignored_and_named(server: Server) -> None:
    """As vLLM, a field the API does not know is ignored; the response names it (X-Ignored-Fields),
    streaming or not, on every JSON POST endpoint. The log line: tests/test_unknown_fields.py."""
    hi = [{"role": "user", "content": "hi"}]
    cases = [  # (path, body, the header)
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "frobnicate": 1, "stream_options": {"x": 1}},
         "frobnicate, stream_options.x"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stream": True, "frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": 1}] * 2, "max_tokens": 2,
                                  "store": True}, "store, messages[].mood"),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "stream": True, "store": True}, "store"),
        ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        ("/detokenize", {"tokens": [504], "frobnicate": 1}, "frobnicate"),
        # A name that could break the header (h11 refuses a value ending in a space: no response at all)
        # or forge a log line is shown as a JSON string in ASCII; plain names stay as they are.
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "x ": 1}, '"x "'),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stream": True, "": 1, "a\nb": 2, "\u00e9": 3,
                             "plain": 4}, '"", "a\\nb", "\\u00e9", plain'),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "\t": 1}], "max_tokens": 2},
         '"messages[].\\t"'),
        ("/tokenize", {"prompt": "hi", " lead": 1, "a, b": 2, "\x7f": 3}, '" lead", "a, b", "\\u007f"'),
        # known fields, whether or not Tandem uses them, are not named
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "user": "u1", "suffix": None, "stream": True,
                             "stream_options": {"include_usage": True}}, None),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "user": "u1", "parallel_tool_calls": False,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "n", "schema": {"type": "object", "made_up": 1}}}}, None),
    ]
    for path, body, header in cases:
        with web.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
            text = r.read().decode()
            assert r.status_code == 200, text
            assert r.headers.get("x-ignored-fields") == header, (body, r.headers)
            if body.get("stream"):
                assert text.rstrip().endswith("data: [DONE]")
