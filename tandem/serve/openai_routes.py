"""The OpenAI routes (/v1/models, /v1/completions, /v1/chat/completions): one APIRouter over the
API's state. Each request is prepared (prepare.py), admitted (calls.py), then collected or streamed
(streams.py)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.serve.api_state import APIState
from tandem.serve.errors import request_id
from tandem.serve.openai_format import Formatter, usage
from tandem.serve.prepare import (
    ChatInput,
    chat_prompt,
    check_model,
    make_params,
    need_text,
    reasoning_opened,
    tokenize,
    validate,
)
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest
from tandem.serve.streams import collect, open_streams, sse


def openai_router(s: APIState) -> APIRouter:
    router = APIRouter()
    engine, text = s.engine, s.text
    admit = s.admission.admit

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        assert engine.info is not None
        return {"object": "list", "data": [{"id": s.started.live.model, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": engine.info.max_model_len}]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        headers = s.fields.check(body, request_id(request.scope))
        live = s.started.live
        check_model(body.model, live)
        params = make_params(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens are scored too (log-likelihoods)
            params.prompt_logprobs = body.logprobs
        await s.grammars.check(params)
        call = s.callers.call_for(request, body)
        admit(call, len(body.prompts()), params)  # before any tokenizing: a refusal costs next to nothing
        texts = [p if isinstance(p, str) else None for p in body.prompts()]
        if any(texts):
            need_text(text).check_chars([t for t in texts if t], "prompt")  # the batch's, before any is tokenized
        prompts = [await tokenize(text, p) for p in body.prompts()]
        for ids in prompts:
            validate(engine, ids, params, "prompt")
        admit(call, len(prompts), params, prompts)
        fmt = Formatter(text.tokenizer, live.model, f"cmpl-{uuid.uuid4().hex}", chat=False)
        worker = text.worker
        echo = [t if t is not None else (await worker.decode(ids) if worker else "")
                for t, ids in zip(texts, prompts, strict=True)] if body.echo else None
        streams = open_streams(engine, live.metrics, prompts, params, texts, call)
        n_prompt = sum(len(p) for p in prompts)
        num_top = body.logprobs or 0
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(streams, fmt, params, n_prompt, include, echo, num_top, call.timeout),
                                     media_type="text/event-stream", headers=headers)
        finals = await collect(request, streams, call.timeout)
        choices = []
        for i, final in enumerate(finals):
            for out in final.outputs:
                shown = (echo[i] if echo else "") + out.text
                echoed = (final.prompt_token_ids, final.prompt_logprobs) if echo and final.prompt_logprobs else None
                choices.append(fmt.choice(i * params.n + out.index, out, shown, num_top, echoed))
        n_out = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return JSONResponse(fmt.response(choices, usage(n_prompt, n_out, cached)), headers=headers)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        headers = s.fields.check(body, request_id(request.scope))
        live = s.started.live
        check_model(body.model, live)
        params = make_params(body, body.max_completion_tokens or body.max_tokens, body.logprobs_count())
        chat = ChatInput([m.as_template_dict() for m in body.messages], body.function_defs(),
                         body.tool_choice_value(), body.parallel_tool_calls, body.add_generation_prompt,
                         body.chat_template, body.chat_template_kwargs)
        call = s.callers.call_for(request, body)
        ids, tools = await chat_prompt(s, chat, params, call)
        fmt = Formatter(text.tokenizer, live.model, f"chatcmpl-{uuid.uuid4().hex}", chat=True,
                        tools=text.tool_format if tools is not None and tools.parse else None,
                        reasoning=text.reasoning, reasoning_opened=reasoning_opened(text, ids))
        streams = open_streams(engine, live.metrics, [ids], params, [None], call)
        num_top = body.top_logprobs or 0
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(streams, fmt, params, len(ids), include, None, num_top, call.timeout),
                                     media_type="text/event-stream", headers=headers)
        final = (await collect(request, streams, call.timeout))[0]
        choices = [fmt.choice(o.index, o, o.text, num_top) for o in final.outputs]
        n_out = sum(len(o.token_ids) for o in final.outputs)
        return JSONResponse(fmt.response(choices, usage(len(ids), n_out, final.num_cached_tokens)), headers=headers)

    return router
