"""What the API route groups (OpenAI's, Anthropic's) share, typed: the engine, the served model, the
text side, and the checks every request passes (callers, admission, grammars, unknown fields)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.disagg.router.engine_client import EngineClient
from tandem.serve.app_state import Started, TextSide
from tandem.serve.calls import Admission, Callers
from tandem.serve.prepare import GrammarCheck
from tandem.serve.unknown_fields import UnknownFields


@dataclass(frozen=True)
class APIState:
    engine: EngineClient
    started: Started  # the served name and the metrics
    text: TextSide
    callers: Callers  # a request's tenant, weight and deadline
    admission: Admission
    grammars: GrammarCheck  # structured outputs, checked before they are queued
    fields: UnknownFields  # a body's fields that no model declares: said so, or refused
