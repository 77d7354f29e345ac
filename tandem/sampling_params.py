"""Per-request sampling settings, shaped like vLLM's SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# torch.Generator.manual_seed takes [-2**63, 2**64) and wraps negatives; one documented range keeps
# a seed meaning one stream (n > 1 children use seed + i, still below 2**64).
MAX_SEED = 2**63


class ParamError(ValueError):
    """A bad request setting; `param` names the field, as an OpenAI error's `param` does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top-k
    # None: none; k >= 0: each prompt token's logprob (after the first) plus the top-k. Such a
    # prompt is computed whole, not read from the prefix cache (its logits are needed).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # constrain the output to a grammar (engine/structured.py)
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before sampling (greedy
    # too); -100 all but bans a token, 100 all but forces it. The logprobs reported stay the model's.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ParamError naming the offending field, as an API error names its param. The checks
        here need no model; InputProcessor.validate adds those that do (vocabulary, context)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # NaN fails every comparison below with a misleading message; inf would pass some of them.
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ParamError(f"{name} must be a finite number", name)
        checks: list[tuple[bool, str, str]] = [
            (_is_int(self.n) and self.n >= 1, "n", "n must be at least 1"),
            (self.temperature >= 0, "temperature", "temperature must be non-negative"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k", "top_k must be -1 (disabled), 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
             f"seed must be an integer in [0, 2**63) (got {self.seed})"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be positive"),
            (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             "max_tokens must be at least 1"),
            (_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must be <= max_tokens"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
             "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop_strings), "stop", "stop must be non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ParamError(message, param)
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ParamError(f"logit_bias keys must be token ids (got {token!r})", "logit_bias")
            # True is an int to Python, but no bias a caller meant.
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) \
                    or not -100 <= bias <= 100:
                raise ParamError(f"logit_bias values must be in [-100, 100] (got {bias!r} for token {token})",
                                 "logit_bias")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must parse as: a JSON schema (kind json, spec its JSON text), any JSON object
    (json_object), a regular expression, one of a JSON list of strings (choice), or a Lark/GBNF grammar
    (vLLM's structured_outputs / guided_* fields; OpenAI's response_format)."""

    kind: str
    spec: str = ""
    # OpenAI's strict (vLLM's disable_additional_properties): a schema's objects that do not say
    # additionalProperties take only the properties they name (engine/structured.py, closed_objects).
    strict: bool = False
    # JSON's whitespace: llguidance's flexible default (any run of it between tokens), or compact (as
    # json.dumps writes it; vLLM's disable_any_whitespace) when False; None: the server's default (compact).
    whitespace_flexible: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ParamError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}", "structured")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
