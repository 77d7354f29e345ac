"""Who is asking and whether they get in: a request's Call (tenant, weight, priority, deadline, cache
salt) and admission against the engine's load (the rules are admission.py's)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from tandem.disagg.router.engine_client import EngineClient
from tandem.policy.admission import AdmissionSettings, Deadlines, Rejection, check_admission
from tandem.policy.refusal_streaks import RefusalStreaks
from tandem.sampling_params import SamplingParams
from tandem.serve.app_state import Started
from tandem.serve.errors import APIError
from tandem.serve.settings import ServerSettings
from tandem.slo import Slo


def key_salts(api_keys: list[str]) -> dict[str, str]:
    """Each API key's salt: the tenant (and cache salt) it stands for; the key itself stays with the middleware."""
    return {k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in api_keys}


@dataclass
class Call:
    """Who is asking and how: the scheduler's tenant and priority, the deadline, the cache salt."""

    tenant: str | None
    weight: float
    priority: int
    timeout: float | None
    salt: str | None
    max_tokens: int | None = None  # as the request named it (None: up to the context's end)


class CallFields(Protocol):
    """What a request body says about its call (every API's body declares these)."""

    priority: int
    timeout: float | None
    cache_salt: str | None
    max_tokens: int | None


@dataclass(frozen=True)
class Callers:
    """How a request becomes a Call: its tenant (API key or tenant header), weight and deadline."""

    tenant_header: str | None
    request_timeout: float | None
    weights: dict[str, float]  # tenant (a key's salt or a header value) -> share

    @classmethod
    def build(cls, settings: ServerSettings, salts: dict[str, str]) -> Callers:
        # Weights are given by key or header value; a key's tenant is its salt.
        weights = {salts.get(name, name): w for name, w in settings.tenant_weights.items()}
        return cls(settings.tenant_header, settings.request_timeout, weights)

    def call_for(self, request: Request, body: CallFields) -> Call:
        tenant = getattr(request.state, "salt", None)
        if self.tenant_header:
            tenant = request.headers.get(self.tenant_header, tenant)
        timeout = self.request_timeout
        if body.timeout is not None:
            timeout = body.timeout if timeout is None else min(timeout, body.timeout)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        return Call(tenant, self.weights.get(tenant, 1.0) if tenant is not None else 1.0, body.priority, timeout,
                    salt_for(request, body.cache_salt), max_tokens)


def salt_for(request: Request, cache_salt: str | None) -> str | None:
    tenant = getattr(request.state, "salt", None)
    if tenant is None:
        return cache_salt
    return f"{tenant}:{cache_salt or ''}"


@dataclass(frozen=True)
class Admission:
    """Admit a call or refuse it: 503 while the engine is down, 429 (with Retry-After) when it is full."""

    engine: EngineClient
    rules: AdmissionSettings
    slo: Slo  # the deadlines the slo mode predicts against
    started: Started  # the metrics count the refusals
    streaks: RefusalStreaks = field(default_factory=RefusalStreaks)  # a tenant's flood, refused untokenized

    def admit(self, call: Call, num_prompts: int, params: SamplingParams,
              prompts: list[list[int]] | None = None) -> None:
        """prompts: the call's token ids once tokenized (None: the check before tokenizing); their
        blocks the prefix cache likely holds are not counted as work."""
        engine = self.engine
        if not engine.healthy:
            raise APIError(503, engine.dead or "engine is not running", "ServiceUnavailableError")
        limit = engine.info.max_model_len if engine.info is not None else 1 << 20
        deadlines = None
        if self.rules.predicts:
            deadlines = Deadlines(engine.shape(), self.slo, call.max_tokens or params.max_tokens or limit,
                                  engine.calibration.ttft, max_tokens_given=call.max_tokens is not None)
        # Before tokenizing, a tenant in a streak of refusals is checked as large as its refused requests.
        assumed = self.streaks.assumed_tokens(call.tenant) if prompts is None else None
        prompt_tokens = assumed or sum(engine.uncached_tokens(ids, call.salt) for ids in prompts or [])
        rejection = check_admission(self.rules, engine.capacity(), engine.load(call.tenant), num_prompts,
                                    num_prompts * params.n, prompt_tokens, engine.prompt_rate.rate, call.timeout,
                                    deadlines)
        if prompts is not None:
            self.streaks.record(call.tenant, rejection is not None, prompt_tokens)
        if rejection is not None:
            if assumed is not None:
                rejection = Rejection(f"{rejection.message} (checked before tokenizing as {assumed} prompt tokens: "
                                      f"your last {self.streaks.refusals(call.tenant)} requests checked in full were "
                                      f"refused)", rejection.retry_after_s)
            live = self.started.live
            live.metrics.rejected.labels(live.model).inc(num_prompts)
            raise APIError(429, rejection.message, "RateLimitError",
                           headers={"Retry-After": str(rejection.retry_after_s)})
