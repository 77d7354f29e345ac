"""The admin routes (/health, /version, /metrics, /v1/cluster) and the tokenizer's (/tokenize,
/detokenize, /tokenizer_info): two APIRouters, each built over the state it may reach."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import tandem
from tandem.disagg.router.engine_client import EngineClient
from tandem.serve import cluster_view
from tandem.serve.app_state import Started, TextSide
from tandem.serve.error_shape import error_body
from tandem.serve.errors import APIError, bad_request, request_id
from tandem.serve.prepare import chat_ids, check_model, need_text
from tandem.serve.protocol import DetokenizeRequest, TokenizeRequest
from tandem.serve.unknown_fields import UnknownFields
from tandem.slo import Slo


@dataclass(frozen=True)
class AdminState:
    engine: EngineClient
    started: Started  # the metrics, the served name, the start time
    slo: Slo | None  # what /v1/cluster's goodput and SLO lines judge by


def admin_router(s: AdminState) -> APIRouter:
    router = APIRouter()
    engine = s.engine

    @router.get("/health")
    async def health() -> Response:
        """200 while requests can be served: {"status": "ok"} or "degraded" with the reasons (a role
        with no live worker); 503 with an error body when nothing can be served."""
        report = engine.health()
        if report["status"] == "unhealthy":
            body = error_body("; ".join(report["reasons"]), "ServiceUnavailableError", 503)
            return JSONResponse(body | report, 503)
        return JSONResponse(report)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem.__version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(s.started.live.metrics.render(engine.stats, engine.info),
                        media_type="text/plain; version=0.0.4")

    @router.get("/v1/cluster")
    async def cluster() -> dict[str, Any]:
        """The deployment, its load and the last minutes' latencies (README "Dashboard")."""
        live = s.started.live
        return cluster_view.snapshot(engine, live.metrics, live.model, s.slo, live.started_at)

    @router.post("/v1/cluster/workers/{worker_id}/migrate")
    async def migrate(worker_id: str) -> dict[str, Any]:
        """Move the requests the worker is decoding to other workers, KV and all, their streams going
        on (a live migration); the worker stays in the deployment."""
        try:
            return await engine.migrate_from(worker_id)
        except LookupError as e:
            raise APIError(404, f"no live worker {worker_id!r}" if isinstance(e, KeyError) else str(e),
                           "NotFoundError", "worker_id") from e

    return router


@dataclass(frozen=True)
class TokenizerState:
    engine: EngineClient  # its limits: max_model_len, vocab_size
    started: Started  # the model's names
    text: TextSide
    fields: UnknownFields  # a body's fields that no model declares: said so, or refused


def tokenizer_router(s: TokenizerState) -> APIRouter:
    router = APIRouter()
    engine, text = s.engine, s.text

    @router.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest, request: Request, response: Response) -> dict[str, Any]:
        response.headers.update(s.fields.check(body, request_id(request.scope)))
        check_model(body.model, s.started.live)
        if body.messages is not None:
            ids = await chat_ids(text, need_text(text), [m.as_template_dict() for m in body.messages], None, True,
                                 None)
        elif body.prompt is not None:
            ids = await need_text(text).encode(body.prompt, body.add_special_tokens)
        else:
            raise bad_request("give prompt or messages", "prompt")
        assert engine.info is not None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's settings, as vLLM serves them: what lm-eval's remote tokenizer reads (its
        special tokens and chat template), so an evaluation needs no copy of the tokenizer."""
        need_text(text)
        assert engine.info is not None
        tokenizer = text.tokenizer
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        special = {name: getattr(tokenizer, name, None) for name in names}
        return {"tokenizer_class": type(tokenizer).__name__, **special, "chat_template": text.template,
                "model_max_length": engine.info.max_model_len, "vocab_size": engine.info.vocab_size,
                "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False))}

    @router.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest, request: Request, response: Response) -> dict[str, Any]:
        response.headers.update(s.fields.check(body, request_id(request.scope)))
        check_model(body.model, s.started.live)
        worker = need_text(text)
        assert engine.info is not None
        if any(t >= engine.info.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be below {engine.info.vocab_size}", "tokens")
        return {"prompt": await worker.decode(body.tokens)}

    return router
