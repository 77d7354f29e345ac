"""The Responses API's routes: POST /v1/responses (whole or streamed), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items. A response is stored (unless `store: false`)
with its conversation, so that a follow-up by previous_response_id sends only its new input."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.outputs import RequestOutput
from tandem.sampling_params import ParamError
from tandem.serve.api_state import APIState
from tandem.serve.errors import APIError, bad_request, request_id
from tandem.serve.prepare import ChatInput, Continuation, chat_prompt, check_model, reasoning_opened
from tandem.serve.responses_api.format import Shown, new_id, response_events, whole
from tandem.serve.responses_api.protocol import ResponsesRequest, template_messages
from tandem.serve.responses_api.store import ResponseStore, StoredResponse
from tandem.serve.streams import collect, interleave, open_streams

PREFIX = "/v1/responses"
# The request's fields a response object echoes back.
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
          "store", "temperature", "tool_choice", "tools", "top_p", "text", "truncation", "reasoning", "user")


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", "NotFoundError", "response_id")


def _tenant(request: Request, s: APIState) -> str | None:
    """Whose stored responses a request may see: its API key's, or its tenant header's."""
    tenant = getattr(request.state, "salt", None)
    header = s.callers.tenant_header
    return request.headers.get(header, tenant) if header else tenant


def _reply_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the template's assistant message: its answer and calls (its reasoning left out)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]}
             for i in output if i["type"] == "function_call"]
    return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})


def responses_router(s: APIState, store: ResponseStore) -> APIRouter:
    router = APIRouter()
    background: set[asyncio.Task] = set()

    def release(handles: list[str]) -> None:
        """Evicted responses' KV given back, without holding up the response that evicted them."""
        task = asyncio.get_running_loop().create_task(s.engine.release_kv(handles))
        background.add(task)
        task.add_done_callback(background.discard)

    @router.post(PREFIX)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        headers = s.fields.check(body, request_id(request.scope))
        live = s.started.live
        check_model(body.model, live)
        tenant = _tenant(request, s)
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, tenant)
            if previous is None:
                raise APIError(404, f"No response found with id '{body.previous_response_id}'.", "NotFoundError",
                               "previous_response_id")
        try:
            items = body.items()
            new_messages = template_messages(items)
            params = body.sampling_params()
        except ParamError as e:
            raise bad_request(str(e), e.param) from e
        system = body.system()
        history = previous.messages if previous is not None else []
        call = s.callers.call_for(request, body)
        continues = None
        if previous is not None and previous.token_ids and previous.system == system and previous.salt == call.salt:
            continues = Continuation(system + history, previous.token_ids)
        chat = ChatInput(system + history + new_messages, body.functions(), body.choice(), body.parallel_tool_calls,
                         continues=continues, tools_param="tools")
        ids, tools = await chat_prompt(s, chat, params, call)
        echoed = body.model_dump(include=set(ECHOED), exclude_none=False)
        shown = Shown(new_id("resp"), live.model, echoed, s.text.tool_format if tools and tools.parse else None,
                      s.text.reasoning, reasoning_opened(s.text, ids))
        input_items = [i.model_dump(exclude_none=True) for i in items]
        for item in input_items:  # as OpenAI lists them: each with an id, a message's text as parts
            item.setdefault("id", new_id("msg" if item.get("type", "message") == "message" else "item"))
            if item.get("type") == "message" and isinstance(item["content"], str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]

        def keep(final: RequestOutput, response: dict[str, Any]) -> None:
            if not body.store:
                return
            out = final.outputs[0]
            ended = out.finish_reason == "stop" and out.stop_reason is None and bool(out.token_ids)
            messages = history + new_messages + [_reply_message(response["output"])]
            evicted = store.put(shown.id, StoredResponse(tenant, response, input_items, messages, system,
                                                         ids + out.token_ids if ended else None, call.salt))
            if evicted:
                release(evicted)

        # A stored response's KV stays cached (retained) in the engine until it is deleted or evicted.
        streams = open_streams(s.engine, live.metrics, [ids], params, [None], call,
                               retain_as=shown.id if body.store else None)
        if body.stream:
            events = response_events(interleave(streams, call.timeout), shown, keep)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        final = (await collect(request, streams, call.timeout))[0]
        response = whole(shown, final)
        keep(final, response)
        return JSONResponse(response, headers=headers)

    @router.get(PREFIX + "/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        stored = store.get(response_id, _tenant(request, s))
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    @router.delete(PREFIX + "/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        if not store.delete(response_id, _tenant(request, s)):
            raise _not_found(response_id)
        await s.engine.release_kv([response_id])
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get(PREFIX + "/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> dict[str, Any]:
        stored = store.get(response_id, _tenant(request, s))
        if stored is None:
            raise _not_found(response_id)
        data = stored.input_items
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    return router
