"""A chat with tools -> what the chat template renders. A template that knows tools gets them as
transformers passes them (`tools=`, and each message's `tool_calls` with their arguments as
objects); for one that does not (SmolLM2's), the tools go into the system prompt in the format's
own words and earlier calls and results into the messages' text, so the model reads the same
format it is asked to write."""

from __future__ import annotations

import json
from typing import Any

from tandem.serve.tool_calls.formats import ToolFormat

TOOLS_PROMPT = """You can call functions to answer the user. Their signatures, as JSON Schema:
<tools>
{tools}
</tools>
To call a function, write {example}"""


def call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """One call as the format writes it."""
    body = json.dumps({"name": name, fmt.args_keys[0]: arguments}, ensure_ascii=False)
    return f"{fmt.open}\n{body}\n{fmt.close}" if fmt.open else body


def calls_text(fmt: ToolFormat, calls: list[tuple[str, Any]]) -> str:
    """A turn's calls as the format writes them in a prompt's history: one per line, or one marked array."""
    bodies = [call_text(fmt, name, arguments) for name, arguments in calls]
    if fmt.array:
        return f"{fmt.prefix}[{fmt.separator.join(bodies)}]"
    return "\n".join(bodies)


def tools_prompt(fmt: ToolFormat, tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    key = fmt.args_keys[0]
    if fmt.open:
        example = (f"a JSON object with its name and arguments between {fmt.open}{fmt.close} tags, one per "
                   f'call:\n{fmt.open}\n{{"name": <function name>, "{key}": <arguments object>}}\n{fmt.close}')
    elif fmt.array:
        example = (f'{fmt.prefix} and then every call in one JSON array: {fmt.prefix}[{{"name": <function name>, '
                   f'"{key}": <arguments object>}}]')
    else:
        example = (f'only the call, as one JSON object: {{"name": <function name>, "{key}": <arguments object>}} '
                   f"(several calls separated by {fmt.separator.strip()!r})")
    return TOOLS_PROMPT.format(tools=listing, example=example)


def template_inputs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template. `messages` are the request's, with `tool_calls`
    (arguments as JSON text) on assistant turns and `tool_call_id` on tool results."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, [{"type": "function", "function": t} for t in tools] if tools else None
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = calls_text(fmt, [(c["name"], json.loads(c["arguments"])) for c in m["tool_calls"]])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = tools_prompt(fmt, tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
