"""The OpenAI-compatible HTTP server (FastAPI), in front of the engine core process."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import tandem
from tandem.config import EngineConfig
from tandem.engine.structured import Grammars
from tandem.outputs import RequestOutput
from tandem.sampling_params import ParamError, SamplingParams, StructuredOutputs
from tandem.serve import cluster_view
from tandem.serve.admission import AdmissionSettings, check_admission
from tandem.serve.async_engine import AsyncEngine, EngineClient
from tandem.serve.dashboard import mount_dashboard
from tandem.serve.errors import APIError, bad_request, install_error_handlers
from tandem.serve.metrics import RequestTimer, ServerMetrics
from tandem.serve.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from tandem.serve.openai_format import Formatter, usage
from tandem.serve.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from tandem.serve.template_sandbox import TemplateSandbox
from tandem.serve.text_worker import TextWorker
from tandem.serve.tool_calls.formats import format_for, template_knows_tools
from tandem.serve.tool_calls.plan import ToolPlan, plan_tools
from tandem.serve.tool_calls.prompt import template_inputs
from tandem.slo import Slo


@dataclass
class ServerSettings:
    served_model_name: str | None = None
    api_keys: list[str] = field(default_factory=list)
    request_timeout: float | None = 600.0
    log_level: str = "WARNING"
    kv_events_endpoint: str | None = None
    max_request_body_bytes: int = 8 << 20
    max_prompt_chars: int = 1_000_000  # all prompts or messages of one request, checked before tokenizing
    trust_request_chat_template: bool = False  # render a request's chat_template (in a sandbox process)
    chat_template_timeout: float = 2.0  # seconds a request's template may render before it is killed
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # Tenants are API keys; or, when named, the value of this header (a gateway's user id).
    tenant_header: str | None = None
    tenant_weights: dict[str, float] = field(default_factory=dict)  # API key or header value -> share
    metrics_require_api_key: bool = False
    slo: Slo | None = None  # what the dashboard's goodput and SLO lines judge by
    tool_call_parser: str = "auto"  # how replies write tool calls (tandem.serve.tool_calls.formats)


@dataclass
class Call:
    """Who is asking and how: the scheduler's tenant and priority, the deadline, the cache salt."""

    tenant: str | None
    weight: float
    priority: int
    timeout: float | None
    salt: str | None


def build_app(config: EngineConfig, settings: ServerSettings, tokenizer: Any | None,
              engine: EngineClient | None = None) -> FastAPI:
    """The OpenAI API over an engine: by default one local engine core; pass another EngineClient
    (the disaggregated router) to serve the same API in front of it."""
    if engine is None:
        engine = AsyncEngine(config, tokenizer, settings.log_level, kv_events_endpoint=settings.kv_events_endpoint)
    state: dict[str, Any] = {}
    key_salts = {k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in settings.api_keys}
    # Weights are given by key or header value; a key's tenant is its salt (the key itself stays here).
    weights = {key_salts.get(name, name): w for name, w in settings.tenant_weights.items()}
    text: TextWorker | None = None
    if tokenizer is not None:
        sandbox = TemplateSandbox(tokenizer.special_tokens_map, settings.chat_template_timeout,
                                  settings.max_prompt_chars) if settings.trust_request_chat_template else None
        text = TextWorker(tokenizer, settings.max_prompt_chars, sandbox)
    model_template = getattr(tokenizer, "chat_template", None)
    tool_format = format_for(model_template, settings.tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        assert engine.info is not None
        state["model"] = settings.served_model_name or engine.info.model_name
        state["metrics"] = ServerMetrics(state["model"], settings.slo)
        state["started_at"] = time.time()
        engine.attach_metrics(state["metrics"])
        if text is not None:
            await text.start()
        sampler = asyncio.create_task(sample_gauges(state["metrics"]))
        yield
        sampler.cancel()
        if text is not None:
            text.close()
        await engine.shutdown()

    async def sample_gauges(metrics: ServerMetrics) -> None:
        """The engine's gauges into the dashboard's time series, whether or not anyone is looking."""
        while True:
            s = engine.stats
            if s is not None:
                metrics.live.gauges(running=s.num_running, waiting=s.num_waiting, kv_usage=s.kv_usage)
            await asyncio.sleep(1.0)

    app = FastAPI(title="Tandem", version=tandem.__version__, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.engine = engine
    install_error_handlers(app)

    # Outermost last: every response, a 401 or a 413 too, carries the request id.
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, key_salts=key_salts, protect_metrics=settings.metrics_require_api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    # -- helpers ------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name not in (state["model"], config.model.model):
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def admit(call: Call, num_prompts: int, params: SamplingParams, prompt_tokens: int = 0) -> None:
        if not engine.healthy:
            raise APIError(503, engine.dead or "engine is not running", "ServiceUnavailableError")
        rejection = check_admission(settings.admission, engine.capacity(), engine.load(call.tenant), num_prompts,
                                    num_prompts * params.n, prompt_tokens, engine.prompt_rate.rate, call.timeout)
        if rejection is not None:
            state["metrics"].rejected.labels(state["model"]).inc(num_prompts)
            raise APIError(429, rejection.message, "RateLimitError",
                           headers={"Retry-After": str(rejection.retry_after_s)})

    def call_for(request: Request, body: Any) -> Call:
        tenant = getattr(request.state, "salt", None)
        if settings.tenant_header:
            tenant = request.headers.get(settings.tenant_header, tenant)
        timeout = settings.request_timeout
        if body.timeout is not None:
            timeout = body.timeout if timeout is None else min(timeout, body.timeout)
        return Call(tenant, weights.get(tenant, 1.0) if tenant is not None else 1.0, body.priority, timeout,
                    salt_for(request, body.cache_salt))

    def salt_for(request: Request, cache_salt: str | None) -> str | None:
        tenant = getattr(request.state, "salt", None)
        if tenant is None:
            return cache_salt
        return f"{tenant}:{cache_salt or ''}"

    def need_text() -> TextWorker:
        if text is None:
            raise bad_request("this model has no tokenizer: send token ids", "prompt")
        return text

    async def tokenize(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt is empty", "prompt")
            return await need_text().encode(prompt)
        return list(prompt)

    def validate(ids: list[int], params: SamplingParams, param: str) -> None:
        assert engine.inputs is not None
        try:
            engine.inputs.validate(ids, params)
        except ValueError as e:  # a ParamError names its field; the others are about the prompt
            raise bad_request(str(e), getattr(e, "param", None) or param) from e

    def make_params(body: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise bad_request(str(e), getattr(e, "param", None)) from e

    async def check_structured(params: SamplingParams, param: str = "response_format") -> None:
        """A grammar that cannot be compiled is the client's error (400), found before it is queued."""
        if params.structured is None:
            return
        if tokenizer is None:
            raise bad_request("structured outputs need the model's tokenizer", param)
        if "grammars" not in state:
            assert engine.info is not None
            state["grammars"] = Grammars(tokenizer, engine.info.vocab_size)
        error = await asyncio.to_thread(state["grammars"].check, params.structured)
        if error:
            raise bad_request(f"invalid {params.structured.kind} constraint: {error.strip()}", param)

    def tool_plan(body: ChatCompletionRequest, params: SamplingParams) -> ToolPlan | None:
        """The request's tools; a forced call (required, a named function) becomes its grammar."""
        try:
            plan = plan_tools(tool_format, body.function_defs(), body.tool_choice_value(), body.parallel_tool_calls)
        except ParamError as e:
            raise bad_request(str(e), e.param) from e
        if plan is not None and plan.grammar is not None:
            if params.structured is not None:
                raise bad_request("tool_choice required or a named function cannot be combined with another "
                                  "output constraint", "tool_choice")
            params.structured = StructuredOutputs("grammar", plan.grammar)
        return plan

    async def chat_ids(worker: TextWorker, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       add_generation_prompt: bool, template: str | None) -> list[int]:
        native = template_knows_tools(template or model_template)
        msgs, native_tools = template_inputs(messages, tools, tool_format, native)
        return await worker.chat_ids(msgs, add_generation_prompt, template, native_tools)

    async def tracked(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Feed the latency histograms from what the client actually receives; a request that ends
        without finishing (a disconnect, a timeout, an error) counts as aborted."""
        metrics: ServerMetrics = state["metrics"]
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

    def open_streams(prompts: list[list[int]], params: SamplingParams, texts: list[str | None],
                     call: Call) -> list[AsyncIterator[RequestOutput]]:
        return [tracked(engine.generate(ids, params, text, call.salt, priority=call.priority, tenant=call.tenant,
                                        tenant_weight=call.weight))
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

    async def sse(streams: list[AsyncIterator[RequestOutput]], fmt: Formatter, params: SamplingParams,
                  n_prompt_tokens: int, include_usage: bool, echo_texts: list[str] | None,
                  num_top: int, timeout: float | None) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in s:
                    await queue.put((i, out))
            except Exception as e:  # surfaces as an error event on the stream
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        deadline = None if timeout is None else time.monotonic() + timeout
        open_count, completion_tokens = len(tasks), 0
        started: set[int] = set()
        try:
            while open_count:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    i, item = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    yield f"data: {json.dumps(error_body('request timed out', 'TimeoutError', 408))}\n\n"
                    return
                if item is None:
                    open_count -= 1
                    continue
                if isinstance(item, Exception):
                    yield f"data: {json.dumps(error_body(str(item), 'InternalServerError', 500))}\n\n"
                    return
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
            if include_usage:
                yield f"data: {json.dumps(fmt.chunk([], usage(n_prompt_tokens, completion_tokens)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                with contextlib.suppress(BaseException):
                    await s.aclose()

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """200 while requests can be served: {"status": "ok"} or "degraded" with the reasons (a role
        with no live worker); 503 with an error body when nothing can be served."""
        report = engine.health()
        if report["status"] == "unhealthy":
            body = error_body("; ".join(report["reasons"]), "ServiceUnavailableError", 503)
            return JSONResponse(body | report, 503)
        return JSONResponse(report)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].render(engine.stats, engine.info), media_type="text/plain; version=0.0.4")

    @app.get("/v1/cluster")
    async def cluster() -> dict[str, Any]:
        """The deployment, its load and the last minutes' latencies (README "Dashboard")."""
        return cluster_view.snapshot(engine, state["metrics"], state["model"], settings.slo, state["started_at"])

    mount_dashboard(app)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        assert engine.info is not None
        return {"object": "list", "data": [{"id": state["model"], "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": engine.info.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            ids = await chat_ids(need_text(), [m.as_template_dict() for m in body.messages], None, True, None)
        elif body.prompt is not None:
            ids = await need_text().encode(body.prompt, body.add_special_tokens)
        else:
            raise bad_request("give prompt or messages", "prompt")
        assert engine.info is not None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's settings, as vLLM serves them: what lm-eval's remote tokenizer reads (its
        special tokens and chat template), so an evaluation needs no copy of the tokenizer."""
        need_text()
        assert engine.info is not None
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        special = {name: getattr(tokenizer, name, None) for name in names}
        return {"tokenizer_class": type(tokenizer).__name__, **special, "chat_template": model_template,
                "model_max_length": engine.info.max_model_len, "vocab_size": engine.info.vocab_size,
                "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False))}

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        worker = need_text()
        assert engine.info is not None
        if any(t >= engine.info.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be below {engine.info.vocab_size}", "tokens")
        return {"prompt": await worker.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = make_params(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens are scored too (log-likelihoods)
            params.prompt_logprobs = body.logprobs
        await check_structured(params)
        call = call_for(request, body)
        admit(call, len(body.prompts()), params)  # before any tokenizing: a refusal costs next to nothing
        texts = [p if isinstance(p, str) else None for p in body.prompts()]
        if any(texts):
            need_text().check_chars([t for t in texts if t], "prompt")  # the batch's, before any is tokenized
        prompts = [await tokenize(p) for p in body.prompts()]
        for ids in prompts:
            validate(ids, params, "prompt")
        admit(call, len(prompts), params, sum(len(p) for p in prompts))
        fmt = Formatter(tokenizer, state["model"], f"cmpl-{uuid.uuid4().hex}", chat=False)
        echo = [t if t is not None else (await text.decode(ids) if text else "")
                for t, ids in zip(texts, prompts, strict=True)] if body.echo else None
        streams = open_streams(prompts, params, texts, call)
        n_prompt = sum(len(p) for p in prompts)
        num_top = body.logprobs or 0
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(streams, fmt, params, n_prompt, include, echo, num_top, call.timeout),
                                     media_type="text/event-stream")
        finals = await collect(request, streams, call.timeout)
        choices = []
        for i, final in enumerate(finals):
            for out in final.outputs:
                shown = (echo[i] if echo else "") + out.text  # (not `text`: that is the TextWorker)
                echoed = (final.prompt_token_ids, final.prompt_logprobs) if echo and final.prompt_logprobs else None
                choices.append(fmt.choice(i * params.n + out.index, out, shown, num_top, echoed))
        n_out = sum(len(o.token_ids) for f in finals for o in f.outputs)
        return JSONResponse(fmt.response(choices, usage(n_prompt, n_out)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if text is None:
            raise bad_request("this model has no tokenizer, so it has no chat template")
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = make_params(body, max_tokens, body.logprobs_count())
        tools = tool_plan(body, params)
        await check_structured(params, "tools" if tools is not None and tools.grammar else "response_format")
        call = call_for(request, body)
        admit(call, 1, params)
        ids = await chat_ids(text, [m.as_template_dict() for m in body.messages], tools.prompt_tools if tools else None,
                             body.add_generation_prompt, body.chat_template)
        if params.max_tokens is None:
            assert engine.info is not None
            params.max_tokens = max(engine.info.max_model_len - len(ids), 1)
        validate(ids, params, "messages")
        admit(call, 1, params, len(ids))
        fmt = Formatter(tokenizer, state["model"], f"chatcmpl-{uuid.uuid4().hex}", chat=True,
                        tools=tool_format if tools is not None and tools.parse else None)
        streams = open_streams([ids], params, [None], call)
        num_top = body.top_logprobs or 0
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(streams, fmt, params, len(ids), include, None, num_top, call.timeout),
                                     media_type="text/event-stream")
        final = (await collect(request, streams, call.timeout))[0]
        choices = [fmt.choice(o.index, o, o.text, num_top) for o in final.outputs]
        n_out = sum(len(o.token_ids) for o in final.outputs)
        return JSONResponse(fmt.response(choices, usage(len(ids), n_out)))

    return app
