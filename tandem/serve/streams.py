"""The engine's outputs on their way to the client: the streams opened for a request (each feeding
the latency metrics), collected to their ends for a JSON response, or pumped out as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from tandem.disagg.router.engine_client import EngineClient
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.serve.calls import Call
from tandem.serve.error_shape import error_body
from tandem.serve.errors import APIError
from tandem.serve.metrics import RequestTimer, ServerMetrics
from tandem.serve.openai_format import Formatter, usage


async def tracked(gen: AsyncIterator[RequestOutput], metrics: ServerMetrics) -> AsyncIterator[RequestOutput]:
    """Feed the latency histograms from what the client actually receives; a request that ends
    without finishing (a disconnect, a timeout, an error) counts as aborted."""
    timer = RequestTimer()
    last: RequestOutput | None = None
    try:
        async for out in gen:
            metrics.observe_chunk(timer, sum(len(d[1]) for d in out.deltas))
            last = out
            yield out
    finally:
        await gen.aclose()
        if last is not None and last.finished:
            queue = (last.metrics.first_scheduled_time - last.metrics.arrival_time
                     if last.metrics.first_scheduled_time else None)
            metrics.observe_finish(timer, last.outputs[0].finish_reason, queue)
        else:
            metrics.observe_finish(timer, "abort", None)


def open_streams(engine: EngineClient, metrics: ServerMetrics, prompts: list[list[int]], params: SamplingParams,
                 texts: list[str | None], call: Call,
                 retain_as: str | None = None) -> list[AsyncIterator[RequestOutput]]:
    """retain_as: one prompt's conversation whose KV stays cached under this handle (a stored response)."""
    return [tracked(engine.generate(ids, params, text, call.salt, priority=call.priority, tenant=call.tenant,
                                    tenant_weight=call.weight, timeout=call.timeout, retain_as=retain_as), metrics)
            for ids, text in zip(prompts, texts, strict=True)]


async def collect(request: Request, streams: list[AsyncIterator[RequestOutput]],
                  timeout: float | None) -> list[RequestOutput]:
    """Run every stream to its end; abort all if the client goes away or time runs out."""
    async def drain(s: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = None
        async for out in s:
            last = out
        assert last is not None
        return last

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.ALL_COMPLETED)
            if await request.is_disconnected():  # the finally below aborts every stream
                raise APIError(499, "client disconnected", "ClientClosedRequest")
            if deadline is not None and time.monotonic() > deadline:
                raise APIError(408, "request timed out", "TimeoutError")
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def interleave(streams: list[AsyncIterator[RequestOutput]],
                     timeout: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The streams' outputs as they come, each with its stream's index. TimeoutError once `timeout`
    seconds have passed; an engine error is raised as it came. Every stream is closed at the end."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except Exception as e:  # raised to the reader, in order
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    deadline = None if timeout is None else time.monotonic() + timeout
    open_count = len(tasks)
    try:
        while open_count:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            i, item = await asyncio.wait_for(queue.get(), left)
            if item is None:
                open_count -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            with contextlib.suppress(BaseException):
                await s.aclose()


async def sse(streams: list[AsyncIterator[RequestOutput]], fmt: Formatter, params: SamplingParams,
              n_prompt_tokens: int, include_usage: bool, echo_texts: list[str] | None,
              num_top: int, timeout: float | None) -> AsyncIterator[str]:
    """The streams, interleaved, as OpenAI's chunks (`data: {...}`), then the usage if asked for and
    `data: [DONE]`; a timeout or an engine error ends the stream with an error event."""
    completion_tokens = 0
    started: set[int] = set()
    cached: dict[int, int] = {}
    outputs = interleave(streams, timeout)
    try:
        async for i, item in outputs:
            cached[i] = item.num_cached_tokens
            choices = []
            for out, (text, tokens) in zip(item.outputs, item.deltas, strict=True):
                index = i * params.n + out.index
                first = index not in started
                if first:
                    started.add(index)
                    if echo_texts is not None:
                        text = echo_texts[i] + text
                completion_tokens += len(tokens)
                finish = out.finish_reason if item.finished or out.finish_reason else None
                if not text and not tokens and finish is None and not (first and fmt.chat):
                    continue
                lp_entries = out.logprobs[len(out.logprobs) - len(tokens):] if out.logprobs is not None \
                    else None
                lp_tokens = tokens
                if first and echo_texts is not None and item.prompt_logprobs is not None and lp_entries is not None:
                    lp_tokens, lp_entries = item.prompt_token_ids + tokens, item.prompt_logprobs + lp_entries
                choice = fmt.chunk_choice(index, text, lp_tokens, lp_entries, num_top, finish,
                                          out.stop_reason if finish else None, role=first and fmt.chat)
                if choice is not None:
                    choices.append(choice)
            if choices:
                yield f"data: {json.dumps(fmt.chunk(choices))}\n\n"
    except TimeoutError:
        yield f"data: {json.dumps(error_body('request timed out', 'TimeoutError', 408))}\n\n"
        return
    except Exception as e:  # an engine error ends the stream with an error event
        yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        return
    finally:
        await outputs.aclose()
    if include_usage:
        usage_body = usage(n_prompt_tokens, completion_tokens, sum(cached.values()))
        yield f"data: {json.dumps(fmt.chunk([], usage_body))}\n\n"
    yield "data: [DONE]\n\n"
