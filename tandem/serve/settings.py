"""`tandem serve`'s server settings: what the HTTP layer is told at start-up (the engine's are EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.policy.admission import AdmissionSettings
from tandem.slo import Slo


@dataclass
class ServerSettings:
    served_model_name: str | None = None
    api_keys: list[str] = field(default_factory=list)
    request_timeout: float | None = 600.0
    log_level: str = "WARNING"
    max_request_body_bytes: int = 8 << 20
    max_prompt_chars: int = 1_000_000  # all prompts or messages of one request, checked before tokenizing
    trust_request_chat_template: bool = False  # render a request's chat_template (in a sandbox process)
    chat_template_timeout: float = 2.0  # seconds a request's template may render before it is killed
    # A request field that no model declares is a 400 (by default: ignored, with a warning and X-Ignored-Fields).
    reject_unknown_fields: bool = False
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # Tenants are API keys; or, when named, the value of this header (a gateway's user id).
    tenant_header: str | None = None
    tenant_weights: dict[str, float] = field(default_factory=dict)  # API key or header value -> share
    metrics_require_api_key: bool = False
    slo: Slo | None = None  # what the dashboard's goodput and SLO lines judge by
    tool_call_parser: str = "auto"  # how replies write tool calls (tandem.serve.tool_calls.formats)
    max_stored_responses: int = 1024  # the Responses API's stored responses (least recently used go first)
    reasoning_parser: str | None = None  # how replies set their reasoning apart (tandem.serve.reasoning)
    # JSON constraints' whitespace when a request does not say (structured_outputs.disable_any_whitespace)
    structured_outputs_whitespace: str = "compact"  # or flexible: llguidance's default
