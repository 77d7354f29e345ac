"""Anthropic's Messages routes: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens,
over the same preparation, admission and engine streams as the OpenAI chat route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.sampling_params import ParamError
from tandem.serve.api_state import APIState
from tandem.serve.errors import ANTHROPIC_PREFIX as PREFIX
from tandem.serve.errors import bad_request, request_id
from tandem.serve.messages_api.format import Reply, message, message_events, message_id
from tandem.serve.messages_api.protocol import ANTHROPIC_ERROR_RESPONSES, CountTokensRequest, MessagesRequest
from tandem.serve.prepare import ChatInput, chat_ids, chat_prompt, check_model, reasoning_opened
from tandem.serve.streams import collect, interleave, open_streams


def _chat_input(body: CountTokensRequest) -> ChatInput:
    try:
        return body.chat_input()
    except ParamError as e:
        raise bad_request(str(e), e.param) from e


def messages_router(s: APIState) -> APIRouter:
    router = APIRouter()

    @router.post(PREFIX, responses=ANTHROPIC_ERROR_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        headers = s.fields.check(body, request_id(request.scope))
        live = s.started.live
        check_model(body.model, live)
        chat = _chat_input(body)
        thinks = body.thinking is not None and body.thinking.type in ("enabled", "between_tools")
        if thinks and s.text.reasoning is None:
            raise bad_request("thinking needs a server started with --reasoning-parser: this one does not "
                              "separate reasoning from the reply", "thinking")
        try:
            params = body.sampling_params()
        except ValueError as e:
            raise bad_request(str(e), getattr(e, "param", None)) from e
        call = s.callers.call_for(request, body)
        ids, tools = await chat_prompt(s, chat, params, call)
        reply = Reply(live.model, message_id(), s.text.tool_format if tools is not None and tools.parse else None,
                      s.text.reasoning, reasoning_opened(s.text, ids))
        streams = open_streams(s.engine, live.metrics, [ids], params, [None], call)
        if body.stream:
            events = message_events(interleave(streams, call.timeout), reply)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        final = (await collect(request, streams, call.timeout))[0]
        return JSONResponse(message(reply, final), headers=headers)

    @router.post(f"{PREFIX}/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES)
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, Any]:
        s.fields.check(body, request_id(request.scope))
        check_model(body.model, s.started.live)
        if s.text.worker is None:
            raise bad_request("this model has no tokenizer, so it has no chat template")
        chat = _chat_input(body)
        ids = await chat_ids(s.text, s.text.worker, chat.messages, chat.functions, True, None, chat.template_kwargs)
        return {"input_tokens": len(ids)}

    return router
