"""The HTTP server (FastAPI): OpenAI's API and Anthropic's Messages, in front of the engine core process.

build_app wires the app: the lifespan (engine start and shutdown), the middleware, the error
handlers and the route groups, each an APIRouter built over the typed state it may reach
(admin_routes.py: admin and tokenizer; openai_routes.py: the OpenAI API; messages_api/: Anthropic's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import tandem
from tandem.config import EngineConfig
from tandem.disagg.router.engine_client import EngineClient
from tandem.serve.admin_routes import AdminState, TokenizerState, admin_router, tokenizer_router
from tandem.serve.api_state import APIState
from tandem.serve.app_state import Live, Started, TextSide
from tandem.serve.calls import Admission, Callers, key_salts
from tandem.serve.dashboard import mount_dashboard
from tandem.serve.error_shape import ERROR_RESPONSES
from tandem.serve.errors import install_error_handlers
from tandem.serve.messages_api.routes import messages_router
from tandem.serve.metrics import ServerMetrics
from tandem.serve.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from tandem.serve.openai_routes import openai_router
from tandem.serve.prepare import GrammarCheck
from tandem.serve.responses_api.routes import responses_router
from tandem.serve.responses_api.store import ResponseStore
from tandem.serve.settings import ServerSettings
from tandem.serve.unknown_fields import UnknownFields
from tandem.slo import DEFAULT_SLO

__all__ = ["ServerSettings", "build_app"]


def build_app(config: EngineConfig, settings: ServerSettings, tokenizer: Any | None,
              engine: EngineClient) -> FastAPI:
    """The OpenAI API over an engine client (the router, over one worker or many); the lifespan starts
    it (or waits for the workers it launched already)."""
    salts = key_salts(settings.api_keys)
    fields = UnknownFields(settings.reject_unknown_fields)
    text = TextSide.build(tokenizer, settings)
    started = Started()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        assert engine.info is not None
        model = settings.served_model_name or engine.info.model_name
        live = Live(model, config.model.model, ServerMetrics(model, settings.slo), time.time())
        started.set(live)
        engine.attach_metrics(live.metrics)
        if text.worker is not None:
            await text.worker.start()
        sampler = asyncio.create_task(sample_gauges(engine, live.metrics))
        yield
        sampler.cancel()
        if text.worker is not None:
            text.worker.close()
        await engine.shutdown()

    app = FastAPI(title="Tandem", version=tandem.__version__, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.engine = engine
    install_error_handlers(app)

    # Outermost last: every response, a 401 or a 413 too, carries the request id.
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, key_salts=salts, protect_metrics=settings.metrics_require_api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    app.include_router(admin_router(AdminState(engine, started, settings.slo)))
    mount_dashboard(app)
    api = APIState(engine, started, text, Callers.build(settings, salts),
                   Admission(engine, settings.admission, settings.slo or DEFAULT_SLO, started),
                   GrammarCheck(tokenizer, engine, settings.structured_outputs_whitespace == "flexible"), fields)
    app.include_router(openai_router(api))
    app.include_router(messages_router(api))
    app.include_router(responses_router(api, ResponseStore(settings.max_stored_responses)))
    app.include_router(tokenizer_router(TokenizerState(engine, started, text, fields)))
    return app


async def sample_gauges(engine: EngineClient, metrics: ServerMetrics) -> None:
    """The engine's gauges into the dashboard's time series, whether or not anyone is looking."""
    while True:
        s = engine.stats
        if s is not None:
            metrics.live.gauges(running=s.num_running, waiting=s.num_waiting, kv_usage=s.kv_usage)
        await asyncio.sleep(1.0)
