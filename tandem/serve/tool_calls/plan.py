"""A chat request's tools and tool_choice -> what the server does: which tools the prompt shows,
whether the reply is parsed for calls, and, for `required` or a named function, the grammar that
makes the reply calls (in the format's own syntax, each call's arguments held to its schema)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammars import COMPACT
from tandem.sampling_params import ParamError
from tandem.serve.tool_calls.formats import ToolFormat

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    prompt_tools: list[dict[str, Any]] | None  # function definitions (name, description, parameters)
    parse: bool  # turn the reply's calls into tool_calls
    grammar: str | None  # a Lark grammar the reply must match (forced calls)


def plan_tools(fmt: ToolFormat, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
               parallel: bool) -> ToolPlan | None:
    """`tools`: the request's function definitions; `choice`: none, auto, required or a function's name
    as {"name": ...}. None when the request has no tools."""
    if not tools:
        if choice not in (None, "none"):
            raise ParamError("tool_choice needs tools", "tool_choice")
        return None
    names = [t["name"] for t in tools]
    if len(set(names)) < len(names):
        raise ParamError("tool names must be unique", "tools")
    if choice is None:
        choice = "auto"
    if choice == "none":  # as vLLM: the prompt still shows the tools, but nothing makes or parses calls
        return ToolPlan(tools, False, None)
    if choice == "auto":
        return ToolPlan(tools, True, None)
    if fmt.harmony:  # a grammar over harmony's special tokens is not built (vLLM's gpt-oss: auto only too)
        raise ParamError(f"tool_choice {json.dumps(choice)} is not supported for the {fmt.name} (harmony) format: "
                         "use auto or none", "tool_choice")
    if choice == "required":
        return ToolPlan(tools, True, forced_calls_grammar(fmt, tools, parallel))
    assert isinstance(choice, dict)
    chosen = [t for t in tools if t["name"] == choice["name"]]
    if not chosen:
        raise ParamError(f"tool_choice names {choice['name']!r}, which is not in tools", "tool_choice")
    return ToolPlan(tools, True, forced_calls_grammar(fmt, chosen, parallel=False))


def call_schema(fmt: ToolFormat, tool: dict[str, Any]) -> dict[str, Any]:
    key = fmt.args_keys[0]
    properties = {"name": {"const": tool["name"]}, key: tool.get("parameters") or ANY_OBJECT}
    return {"type": "object", "properties": properties, "required": ["name", key], "additionalProperties": False}


def forced_calls_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark (llguidance's dialect, whose %json takes a schema): one call, or several if parallel,
    compact as json.dumps writes them (and as the prompt shows them)."""
    schemas = [call_schema(fmt, t) for t in tools]
    body = "%json " + json.dumps(COMPACT | (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}))
    call = f"{json.dumps(fmt.open + chr(10))} {body} {json.dumps(chr(10) + fmt.close)}" if fmt.open and fmt.close \
        else body
    start = f"call ({json.dumps(fmt.separator)} call)*" if parallel else "call"
    if fmt.array:  # the marker, then the calls as one JSON array
        start = f"{json.dumps(f'{fmt.prefix}[')} {start} {json.dumps(']')}"
    return f"start: {start}\ncall: {call}\n"
