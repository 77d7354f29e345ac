"""Grammars for structured outputs: a request's JSON schema, regex, choice or Lark grammar as llguidance
takes it, and llguidance's view of a tokenizer to check and match them against. No torch: the API
process checks grammars here before a request reaches an engine (engine/structured.py masks logits).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from tandem.sampling_params import StructuredOutputs

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# JSON as json.dumps writes it. llguidance's default lets any run of whitespace sit between tokens, and
# a sampled reply can wander into newlines there until max_tokens runs out (issue #33).
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}

# Where a schema holds subschemas of other values (its properties', its items'): a map of them, a list
# of them (prefixItems), or one (items may be either). Each describes its value alone: closed as a whole.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "contains",
               "propertyNames")
# Subschemas that apply to the schema's own instance, alongside it: they may name or require properties
# that it does not, so neither they nor a schema that has them are closed (that would refuse what the
# schema accepts). `not` and `if` are kept as written, nested objects too: closing inside a negation or
# a condition widens what the schema accepts, or switches a branch.
_UNIONS = ("anyOf", "oneOf")
_REFINING_LISTS = ("allOf", *_UNIONS)
_REFINING_ONE = ("then", "else")
_REFINING = (*_REFINING_LISTS, *_REFINING_ONE, "if", "dependentSchemas")


def _names_an_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and any(k in schema for k in ("properties", "required", "patternProperties")))


def closed_objects(schema: Any, whole: bool = True) -> Any:
    """OpenAI's (and xgrammar's) strict mode: every object schema that does not say
    additionalProperties gets additionalProperties false, at any depth; the schema is not changed.
    Combinators keep their meaning: a branch of allOf, anyOf, oneOf, then, else or dependentSchemas
    constrains its parent's instance (whole False), so it stays open, and so does a parent that has
    such branches (or an if); what is nested in a branch is closed. `not` and `if` are left as written.
    One exception: the branches of a union that says nothing of its own about objects
    ({"anyOf": [A, {"type": "null"}]}) each describe the whole value, and are closed as any object is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    union_of_wholes = whole and not _names_an_object(out)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    if isinstance(out.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {k: closed_objects(v, False) for k, v in out["dependentSchemas"].items()}
    for key in ("prefixItems", *_REFINING_LISTS):
        if isinstance(out.get(key), list):
            branch_whole = key == "prefixItems" or (key in _UNIONS and union_of_wholes)
            out[key] = [closed_objects(v, branch_whole) for v in out[key]]
    for key in (*_SCHEMA_ONE, *_REFINING_ONE):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key], key in _SCHEMA_ONE)
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    if whole and _closable(out):
        out["additionalProperties"] = False
    return out


def _closable(schema: dict[str, Any]) -> bool:
    """An object schema that says nothing of its other properties and has no branches. One that
    requires a property it does not name stays open: closed, it would take no value at all."""
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and any(k in schema for k in ("properties", "patternProperties")))
    named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return is_object and not any(k in schema for k in (*_REFINING, "additionalProperties", "unevaluatedProperties")) \
        and all(name in named for name in required)


def json_schema_of(so: StructuredOutputs) -> Any:
    """The schema llguidance is given for a json or json_object constraint: closed when strict, compact
    unless whitespace_flexible (a schema's own x-guidance is kept)."""
    schema: Any = ANY_JSON_OBJECT if so.kind == "json_object" else json.loads(so.spec)
    if so.strict and so.kind == "json":  # json_object names no properties: closed, it would be only {}
        schema = closed_objects(schema)
    if not so.whitespace_flexible and (isinstance(schema, dict) or schema is True):
        schema = COMPACT | ({} if schema is True else schema)
    return schema


def grammar_of(so: StructuredOutputs) -> str:
    import llguidance

    if so.kind in ("json", "json_object"):
        return llguidance.grammar_from("json_schema", json.dumps(json_schema_of(so)))
    if so.kind == "choice":
        choices = json.loads(so.spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", so.spec)
    return llguidance.grammar_from("regex" if so.kind == "regex" else "grammar", so.spec)


class Grammars:
    """llguidance's view of one tokenizer (built on first use: about half a second), and the grammars
    checked or matched against it."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 load: Callable[[], Any | None] | None = None) -> None:
        """load: where tokenizer is None, what loads it on first use (None from it: the model has none)."""
        self._tokenizer = tokenizer
        self._load = load
        self._ll: Any = None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)

    @property
    def ll(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                if self._tokenizer is None and self._load is not None:
                    self._tokenizer = self._load()
                if self._tokenizer is None:
                    raise ValueError("this model has no tokenizer: grammar-constrained output needs one")
                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size)
            return self._ll

    def check(self, so: StructuredOutputs) -> str | None:
        """Why the grammar cannot be used (None: it can)."""
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_of(so), self.ll)
        except (ValueError, json.JSONDecodeError) as e:
            return str(e)
        return error or None

    def matcher(self, so: StructuredOutputs) -> Any:
        import llguidance

        m = llguidance.LLMatcher(self.ll, grammar_of(so))
        if m.is_error():
            raise ValueError(f"invalid {so.kind} grammar: {m.get_error()}")
        return m
