"""The engine's frontend halves: prompts -> validated Requests, and core outputs -> RequestOutputs.

Both run where the user is (the offline LLM, or the API server's process), never in the core's
step loop. A request with n > 1 becomes n child requests in the core, gathered back here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.logprobs import SampleLogprobs
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import ParamError, SamplingParams

PromptType = str | list[int]


def check_encodable(text: str, param: str | None = None) -> None:
    """Raise ParamError for text that has no UTF-8 form: a lone surrogate (a JSON "\\ud800" escape
    decodes to one). The tokenizer would fail on it with a TypeError that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(f"{param or 'the text'} cannot be encoded as UTF-8: it has a lone surrogate "
                         f"({text[e.start]!r} at position {e.start})", param) from None


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # every token that ends a generation
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


class InputProcessor:
    def __init__(self, tokenizer: Any | None, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            check_encodable(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a string or a list of token ids")
        return None, list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The checks that need the model; a ParamError names the field (None: the prompt)."""
        lim = self.limits
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= lim.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {lim.vocab_size})")
        if len(prompt_ids) >= lim.max_model_len:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens, but this model's maximum context length "
                             f"is {lim.max_model_len} tokens (prompt plus at least one generated token)")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > lim.max_model_len:
            raise ValueError(f"this model's maximum context length is {lim.max_model_len} tokens, but "
                             f"{len(prompt_ids) + params.max_tokens} were requested ({len(prompt_ids)} in the "
                             f"prompt, {params.max_tokens} to generate)")
        if not lim.enable_chunked_prefill and len(prompt_ids) > lim.max_num_batched_tokens:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens, more than max_num_batched_tokens "
                             f"({lim.max_num_batched_tokens}) with chunked prefill disabled")
        if len(prompt_ids) + params.min_tokens > lim.max_model_len:
            raise ParamError(f"this model's maximum context length is {lim.max_model_len} tokens, but the prompt "
                             f"({len(prompt_ids)}) plus min_tokens ({params.min_tokens}) exceed it", "min_tokens")
        if params.top_k > lim.vocab_size:
            raise ParamError(f"top_k must be at most the vocabulary size ({lim.vocab_size}); -1 or 0 disable it",
                             "top_k")
        outside = [t for t in params.stop_token_ids if t >= lim.vocab_size]
        if outside:
            raise ParamError(f"stop_token_ids must be in [0, {lim.vocab_size}) (got {outside[0]})", "stop_token_ids")
        outside = [t for t in params.logit_bias or () if t >= lim.vocab_size]
        if outside:
            raise ParamError(f"logit_bias token ids must be in [0, {lim.vocab_size}) (got {outside[0]})", "logit_bias")

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      cache_salt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                      tenant: str | None = None, tenant_weight: float = 1.0,
                      retain_kv_as: str | None = None) -> list[EngineCoreRequest]:
        """The requests to send for a call: one, or n children sharing the prompt. retain_kv_as: a
        stored conversation's handle (one request only: n > 1 is never stored)."""
        params.validate()
        self.validate(prompt_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt = tuple(prompt_ids)
        common = dict(eos_token_ids=self.limits.eos_token_ids, cache_salt=cache_salt, arrival_time=arrival,
                      priority=priority, tenant=tenant, tenant_weight=tenant_weight)
        if params.n == 1:
            return [EngineCoreRequest(request_id, prompt, params, retain_kv_as=retain_kv_as, **common)]
        # The prompt is the same for every child, so only the first scores it (the parent's output
        # takes its logprobs); the others, not wanting them, may reuse its blocks from the prefix cache.
        return [EngineCoreRequest(child_id(request_id, i), prompt,
                                  replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                          prompt_logprobs=params.prompt_logprobs if i == 0 else None), **common)
                for i in range(params.n)]


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class _Sequence:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    emitted_text: int = 0
    emitted_tokens: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    seqs: dict[str, _Sequence]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    awaits_prompt_logprobs: bool = False  # asked for, not yet here


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, requests: list[EngineCoreRequest]) -> None:
        seqs = {}
        for i, r in enumerate(requests):
            detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids,
                                           r.sampling_params.skip_special_tokens) if self.tokenizer else None
            seqs[r.request_id] = _Sequence(i, r.sampling_params, detok,
                                           logprobs=[] if r.sampling_params.logprobs is not None else None,
                                           cumulative_logprob=0.0 if r.sampling_params.logprobs is not None else None)
            self.child_to_parent[r.request_id] = request_id
        self.parents[request_id] = _Parent(request_id, prompt, list(requests[0].prompt_token_ids),
                                           requests[0].arrival_time, seqs,
                                           awaits_prompt_logprobs=requests[0].sampling_params.prompt_logprobs
                                           is not None)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.seqs) if parent else []

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark a request aborted (the caller aborts it in the core) and return its last output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs.values():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._finish_parent(parent)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs for every request that changed, and the child request ids that a stop
        string finished (the caller aborts them in the core)."""
        changed: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted meanwhile
            parent = self.parents[parent_id]
            seq = parent.seqs[out.request_id]
            if self._update(seq, out):
                to_abort.append(out.request_id)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *(_entry(lp) for lp in out.prompt_logprobs)]  # the first: none
                parent.awaits_prompt_logprobs = False
            changed[parent_id] = parent
        results = []
        for parent in changed.values():
            done = all(s.finish_reason is not None for s in parent.seqs.values())
            if done:
                results.append(self._finish_parent(parent))
            elif not parent.awaits_prompt_logprobs:
                results.append(self._make_output(parent, False))
            # else: a child that does not score the prompt got ahead of the one that does; its tokens
            # wait (unemitted) so that every choice's first chunk carries the echoed prompt's logprobs.
        return results, to_abort

    def _update(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Apply one core output; True if a stop string ended the sequence here."""
        seq.first_token_time = seq.first_token_time or out.first_token_time
        seq.scheduled_time = seq.scheduled_time or out.scheduled_time
        seq.num_cached_tokens, seq.num_preemptions = out.num_cached_tokens, out.num_preemptions
        if out.finished:
            seq.finish_reason, seq.stop_reason, seq.finish_time = out.finish_reason, out.stop_reason, out.finish_time
        stops = seq.params.stop_strings if seq.detok is not None else []
        ids = out.new_token_ids
        # Several tokens in one output (accepted drafts) meet stop strings one at a time, so that a
        # stop ends the output at the token that completed it, as it would have one step at a time.
        groups = [ids[i:i + 1] for i in range(len(ids))] if stops and len(ids) > 1 else [ids]
        lps = iter(out.new_logprobs)
        for n, group in enumerate(groups):
            last = n == len(groups) - 1
            seq.token_ids.extend(group)
            for lp in (next(lps, None) for _ in group):
                if lp is not None:
                    self._add_logprob(seq, lp)
            if seq.detok is None:
                continue
            delta = seq.detok.add(group, final=out.finished and last)
            seq.text += delta
            hit = find_stop(seq.text, len(delta), stops) if delta and stops else None
            if hit is not None:
                start, stop = hit
                seq.text = seq.text[:start + (len(stop) if seq.params.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", stop
                seq.finish_time = seq.finish_time or time.monotonic()
                return not out.finished
        return False

    @staticmethod
    def _add_logprob(seq: _Sequence, lp: SampleLogprobs) -> None:
        assert seq.logprobs is not None and seq.cumulative_logprob is not None
        seq.logprobs.append(_entry(lp))
        seq.cumulative_logprob += lp.token_logprob

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        completions, deltas = [], []
        for seq in parent.seqs.values():
            # While a stop string may still complete, hold back the text that could be its start.
            hold = 0 if seq.finish_reason else max((len(s) - 1 for s in seq.params.stop_strings), default=0)
            visible = max(len(seq.text) - hold, seq.emitted_text)
            deltas.append((seq.text[seq.emitted_text:visible], seq.token_ids[seq.emitted_tokens:]))
            seq.emitted_text, seq.emitted_tokens = visible, len(seq.token_ids)
            completions.append(CompletionOutput(seq.index, seq.text[:visible], list(seq.token_ids),
                                                seq.cumulative_logprob,
                                                list(seq.logprobs) if seq.logprobs is not None else None,
                                                seq.finish_reason, seq.stop_reason))
        seqs = list(parent.seqs.values())
        first_tokens = [s.first_token_time for s in seqs if s.first_token_time is not None]
        scheduled = [s.scheduled_time for s in seqs if s.scheduled_time is not None]
        metrics = RequestMetrics(parent.arrival_time, min(scheduled, default=None), min(first_tokens, default=None),
                                 max((s.finish_time or 0.0 for s in seqs), default=None) if finished else None,
                                 seqs[0].num_cached_tokens, sum(s.num_preemptions for s in seqs))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                             metrics, seqs[0].num_cached_tokens, deltas, parent.prompt_logprobs)

    def _finish_parent(self, parent: _Parent) -> RequestOutput:
        for child in parent.seqs:
            self.child_to_parent.pop(child, None)
        del self.parents[parent.request_id]
        return self._make_output(parent, True)

    def has_unfinished(self) -> bool:
        return bool(self.parents)


def _entry(lp: SampleLogprobs) -> dict[int, Logprob]:
    """{token id: Logprob}: the top tokens by rank, and the scored token with its own rank."""
    top = zip(lp.top_ids, lp.top_logprobs, strict=True)
    entry = {tid: Logprob(v, rank + 1) for rank, (tid, v) in enumerate(top)}
    entry.setdefault(lp.token_id, Logprob(lp.token_logprob, lp.token_rank))
    return entry
