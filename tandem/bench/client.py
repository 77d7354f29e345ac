"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class EndpointConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `start` counts from the benchmark's start."""

    index: int
    session: int
    turn: int
    category: str
    prompt_len: int
    expected_output_len: int
    start: float = 0.0
    success: bool = False
    error: str = ""
    status: int = 0  # the HTTP status (0: no response)
    retry_after: str | None = None  # a refusal's Retry-After header
    ttft: float = 0.0
    latency: float = 0.0  # end to end: last chunk minus send
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between successive content chunks
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for a single token."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """Arrival of each content chunk, in seconds after the benchmark's start."""
        if not self.success:
            return []
        t = self.start + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times


def build_body(cfg: EndpointConfig, prompt: str | list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": cfg.temperature}
    if cfg.chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        # Both names: newer servers read max_completion_tokens, older ones only max_tokens.
        body |= {"messages": messages, "max_completion_tokens": max_tokens, "max_tokens": max_tokens}
    else:
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        body |= {"prompt": text, "max_tokens": max_tokens}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension that Tandem, SGLang and llama.cpp's server accept too
    return body | cfg.extra_body


def _delta_text(chunk: dict[str, Any], chat: bool) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            # Reasoning models stream their thinking first; it is output the server generated.
            text += (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def send_request(http: httpx.AsyncClient, cfg: EndpointConfig, prompt: str | list[dict[str, str]],
                       record: RequestRecord, origin: float, count_tokens: Callable[[str], int],
                       clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """Send one streaming request, filling `record` (which it returns). Never raises for a failed request.

    `origin` is the benchmark's start on `clock`. Output tokens come from the server's usage
    report when it sends one, otherwise from `count_tokens` on the text.
    """
    body = build_body(cfg, prompt, record.expected_output_len)
    usage_tokens: int | None = None
    chunks: list[float] = []
    text_parts: list[str] = []
    sent = clock()
    record.start = sent - origin
    try:
        async with http.stream("POST", cfg.url, json=body, headers=cfg.headers()) as resp:
            record.status, record.retry_after = resp.status_code, resp.headers.get("retry-after")
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                record.error = f"HTTP {resp.status_code}: {detail}"
                return record
            async for line in resp.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    record.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return record
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                text = _delta_text(chunk, cfg.chat)
                if text:
                    chunks.append(now)
                    text_parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if not chunks:
        record.error = "no content in the response"
        return record
    record.generated_text = "".join(text_parts)
    record.ttft = chunks[0] - sent
    record.latency = chunks[-1] - sent
    record.itl = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
    record.output_tokens = usage_tokens if usage_tokens is not None else count_tokens(record.generated_text)
    record.success = True
    return record
