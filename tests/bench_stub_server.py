"""A scripted OpenAI-compatible streaming server on loopback, and a word-per-token tokenizer, for bench tests.

The prompt (or the last user message) scripts the reply with `key=value` words, so a test knows the
delays it should measure:

    ttft=0.2   seconds before the first chunk
    itl=0.05   seconds between chunks (or a comma list, one gap per chunk after the first)
    n=5        content chunks (default: max_tokens)
    tpc=1      tokens per chunk, as reported in usage
    usage=0    leave the usage chunk out (the client must count tokens itself)
    reported=7 the completion_tokens that usage reports (default: chunks * tpc)
    status=500 answer with that HTTP status instead
    fail=2     send an error event after that many chunks
"""

from __future__ import annotations

import asyncio
import itertools
import json
import string
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from server_utils import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "stub-model"


class WordTokenizer:
    """Every whitespace-separated word is one token; decode puts a space before each word."""

    def __init__(self, size: int = 3000) -> None:
        words = ("".join(t) for t in itertools.product(string.ascii_lowercase, repeat=3))
        self.vocab = ["<eos>", *itertools.islice(words, size - 1)]
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ids.get(w, 0) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(" " + self.vocab[i] for i in token_ids)


def parse_script(text: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


class StubServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict[str, Any]] = []
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
        ])
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                loop="asyncio", http="h11")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        script = parse_script(prompt)
        if "status" in script:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=int(script["status"]))
        n = int(script.get("n", body.get("max_tokens", 16)))
        gaps = [float(x) for x in script.get("itl", "0.001").split(",")]
        gaps = gaps * (n - 1) if len(gaps) == 1 else gaps
        return StreamingResponse(self._stream(body, chat, n, float(script.get("ttft", "0.001")), gaps,
                                              int(script.get("tpc", "1")), script.get("usage", "1") == "1",
                                              int(script.get("fail", "-1")), script.get("reported")),
                                 media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool, n: int, ttft: float, gaps: list[float], tpc: int,
                      usage: bool, fail: int, reported: str | None) -> AsyncIterator[str]:
        def chunk(text: str, finish: str | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": ""} if not text else {"content": text}
            else:
                choice["text"] = text
            return f"data: {json.dumps({'id': 'x', 'model': MODEL, 'choices': [choice]})}\n\n"

        # Sleep to absolute deadlines so the scripted times do not drift with scheduling overhead.
        start = time.perf_counter()
        if chat:
            yield chunk("")  # a role-only first chunk, as real servers send: not content, not the first token
        due = start + ttft
        for i in range(n):
            if i == fail:
                yield f"data: {json.dumps({'error': {'message': 'scripted stream error'}})}\n\n"
                return
            await asyncio.sleep(max(due - time.perf_counter(), 0))
            yield chunk(" tok" * tpc, "length" if i == n - 1 else None)
            if i < n - 1:
                due += gaps[i]
        if usage:
            out = n * tpc if reported is None else int(reported)
            u = {"prompt_tokens": 1, "completion_tokens": out, "total_tokens": 1 + out}
            yield f"data: {json.dumps({'id': 'x', 'model': MODEL, 'choices': [], 'usage': u})}\n\n"
        yield "data: [DONE]\n\n"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("stub server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextmanager
def stub_server() -> Iterator[StubServer]:
    server = StubServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
