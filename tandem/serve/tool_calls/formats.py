"""How a model family writes a tool call, as vLLM's `--tool-call-parser` names them.

A call is one JSON object with the function's name and its arguments. `hermes` (Hermes, Qwen,
SmolLM and most ChatML models) wraps each in `<tool_call>` tags, anywhere in the reply; `llama3_json`
(Llama 3.1+) makes the whole reply calls, optionally after `<|python_tag|>`, separated by `;`;
`mistral` (Mistral's v3 tokenizer and the models trained on it) makes the reply `[TOOL_CALLS]` and a
JSON array of the calls; `phi4_mini_json` (Phi-4-mini) the same array after `functools`; `openai`
(gpt-oss) writes a call as a harmony message addressed to the function, its body the arguments
(tandem/serve/harmony.py parses it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str | None  # the tag before each call; None: calls start the reply
    close: str | None
    args_keys: tuple[str, ...]  # the arguments' key, the first one is the one written in prompts
    separator: str  # between calls, in prompts and in forced-call grammars
    prefix: str | None = None  # a marker before the first call (open is None); optional unless prefix_required
    prefix_required: bool = False  # without the marker the reply is content
    array: bool = False  # the calls are one JSON array after the marker: [call, call]
    harmony: bool = False  # gpt-oss's channels (tandem/serve/harmony.py), not JSON objects in the text


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", ("arguments",), "\n")
LLAMA3_JSON = ToolFormat("llama3_json", None, None, ("parameters", "arguments"), "; ", "<|python_tag|>")
MISTRAL = ToolFormat("mistral", None, None, ("arguments",), ", ", "[TOOL_CALLS]", prefix_required=True, array=True)
PHI4_MINI_JSON = ToolFormat("phi4_mini_json", None, None, ("arguments",), ", ", "functools", prefix_required=True,
                            array=True)
OPENAI = ToolFormat("openai", None, None, ("arguments",), "", harmony=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI_JSON, OPENAI)}


def format_for(chat_template: str | None, requested: str = "auto") -> ToolFormat:
    """`--tool-call-parser`: a name, or auto: what the model's chat template writes (a template that
    knows nothing of tools gets Hermes's, which Tandem puts in the system prompt itself)."""
    if requested != "auto":
        if requested not in FORMATS:
            raise ValueError(f"unknown tool call parser {requested!r} (choose from auto, {', '.join(FORMATS)})")
        return FORMATS[requested]
    template = chat_template or ""
    if "<|channel|>" in template:
        return OPENAI
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "functools[" in template:
        return PHI4_MINI_JSON
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return HERMES


def template_knows_tools(chat_template: str | None) -> bool:
    """Whether the template renders `tools` itself (else Tandem writes them into the system prompt)."""
    return chat_template is not None and "tools" in chat_template
