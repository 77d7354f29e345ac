"""RequestOutputs -> OpenAI response and stream-chunk bodies (completions and chat)."""

from __future__ import annotations

import time
from typing import Any

from tandem.outputs import CompletionOutput, Logprob
from tandem.serve.reasoning import ReasoningFormat, split_reply
from tandem.serve.reply_parser import ReplyParser
from tandem.serve.tool_calls.formats import ToolFormat
from tandem.serve.tool_calls.parser import Delta, ToolCallDelta, parse_reply

# JSON has no -inf: a token the model cannot emit is reported at this floor, as vLLM's server does.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class Formatter:
    """`tools`: the format a chat reply's tool calls are parsed in (None: the reply is all content);
    `reasoning`: how it sets its reasoning apart (reasoning_content), the rest then read for calls;
    `reasoning_opened`: the prompt ended inside the reasoning."""

    def __init__(self, tokenizer: Any | None, model: str, request_id: str, chat: bool,
                 tools: ToolFormat | None = None, reasoning: ReasoningFormat | None = None,
                 reasoning_opened: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.id = request_id
        self.chat = chat
        self.tools = tools
        self.reasoning, self.reasoning_opened = reasoning, reasoning_opened
        self._replies: dict[int, ReplyParser] = {}  # by choice index, while streaming
        self.created = int(time.time())

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    # -- logprobs -----------------------------------------------------------------------------
    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None] | None, num_top: int,
                 text_offset: int = 0) -> dict[str, Any] | None:
        """`entries` may hold None (an echoed prompt's first token: nothing scored it)."""
        if entries is None:
            return None
        if self.chat:
            content = []
            for tid, entry in zip(token_ids, entries, strict=False):
                tok = self._token_str(tid)
                top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]
                content.append({"token": tok, "logprob": _finite(entry[tid].logprob), "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": self._token_str(t), "logprob": _finite(lp.logprob),
                                                  "bytes": list(self._token_str(t).encode())} for t, lp in top]})
            return {"content": content}
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for tid, entry in zip(token_ids, entries, strict=False):
            tok = self._token_str(tid)
            tokens.append(tok)
            token_lps.append(_finite(entry[tid].logprob) if entry is not None else None)
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top] if entry is not None else None
            tops.append({self._token_str(t): _finite(lp.logprob) for t, lp in top} if top is not None else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # -- whole responses ----------------------------------------------------------------------
    def choice(self, index: int, out: CompletionOutput, text: str, num_top: int,
               echoed: tuple[list[int], list[dict[int, Logprob] | None]] | None = None) -> dict[str, Any]:
        """`echoed`: the prompt's tokens and logprobs, ahead of the output's (completions' echo)."""
        lp = self.logprobs(out.token_ids, out.logprobs, num_top)
        if echoed is not None and out.logprobs is not None:
            lp = self.logprobs(echoed[0] + out.token_ids, echoed[1] + out.logprobs, num_top)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning is not None:
                split = split_reply(self.reasoning, text, self.reasoning_opened)
                message["reasoning_content"] = split.reasoning or None
                message["content"] = text = split.content
            finish = out.finish_reason
            if self.tools is not None:
                parsed = parse_reply(self.tools, text)
                message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [_call_json(c) for c in parsed.calls]
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish,
                    "stop_reason": out.stop_reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage}

    # -- stream chunks ------------------------------------------------------------------------
    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def chunk_choice(self, index: int, text: str, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                     num_top: int, finish_reason: str | None, stop_reason: int | str | None = None,
                     role: bool = False) -> dict[str, Any] | None:
        """None when there is nothing to send yet (text held back as maybe part of a tool call).
        An echoed prompt's tokens and logprobs come first in token_ids and entries."""
        lp = self.logprobs(token_ids, entries, num_top)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            reply = self._replies.get(index)
            if reply is None:
                reply = self._replies[index] = ReplyParser(self.tools, self.reasoning, self.reasoning_opened)
            piece = reply.feed(text, final=finish_reason is not None)
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if self.tools is None:
                if piece.delta.content or role:
                    delta["content"] = piece.delta.content
            else:
                if finish_reason == "stop" and reply.num_calls:
                    finish_reason = "tool_calls"
                delta |= _delta_json(piece.delta, role)
            held = self.tools is not None or self.reasoning is not None  # text a parser holds back
            if held and not delta and lp is None and finish_reason is None:
                return None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


def _call_json(call: ToolCallDelta) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta_json(parsed: Delta, role: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if parsed.content or role:
        out["content"] = parsed.content
    if parsed.calls:
        out["tool_calls"] = [{"index": c.index} | (_call_json(c) if c.id is not None else
                                                    {"function": {"arguments": c.arguments}}) for c in parsed.calls]
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """cached_tokens: the prompt's tokens the prefix cache (or the KV store) held, as OpenAI reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
