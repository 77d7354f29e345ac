"""Logits -> tokens, with per-request parameters, vectorised over the batch; and the verification
of speculative drafts, which is the same operation.

Random sampling uses the exponential race: the token at a position is argmax(p / E) with E ~ Exp(1)
drawn for that position. A seeded request draws each position's E from a generator seeded by
(seed, position), so its tokens depend neither on the batch nor on speculation.

Verification (speculative decoding): a request with k drafts has k + 1 logits rows, row j after
its j-th draft. Each row's token is chosen exactly as above, in that row's context (penalties and
min_tokens count the drafts before it); the drafts are accepted while they equal their row's
token, and the first row that disagrees (or the row after the last draft) adds its own token. For
greedy rows that is "accept while draft = argmax". For sampled rows it accepts a draft x with
probability P(argmax(p / E) = x) = p(x) and otherwise emits a token distributed as p without x,
renormalised: rejection sampling for a deterministic proposal, so the output keeps the target
distribution exactly, and a seeded request's tokens equal those it would have had without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.logprobs import SampleLogprobs
from tandem.engine.request import Request
from tandem.ops import fused
from tandem.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token of its own
    logprobs: list[list[SampleLogprobs] | None]


@dataclass
class DraftRow:
    """A request's logits row after `offset` of its drafts: what penalties and min_tokens see there."""

    request: Request
    drafts: list[int]
    offset: int

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts[:self.offset]

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts[:self.offset]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.offset

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.request.eos_token_ids


Row = Request | DraftRow


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of a seeded request's noise at one output position (splitmix64 of both)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF)


def _penalise(logits: torch.Tensor, requests: list[Row]) -> torch.Tensor:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.presence_penalty
            or r.sampling_params.frequency_penalty or r.sampling_params.repetition_penalty != 1.0]
    if not rows:
        return logits
    vocab = logits.shape[1]
    for i in rows:  # only rows that ask for penalties pay for them
        p = requests[i].sampling_params
        out_ids = torch.tensor(requests[i].output_token_ids, dtype=torch.long)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(requests[i].all_token_ids, dtype=torch.long)] = True
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
                              row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def _mask_min_tokens(logits: torch.Tensor, requests: list[Row]) -> None:
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            stops = list(p.stop_token_ids)
            if not p.ignore_eos:
                stops += r.eos_token_ids
            if stops:
                logits[i, stops] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Apply top-k, top-p and min-p to temperature-scaled logits; rows with neither are untouched."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).expand_as(sorted_logits)
    remove = ranks >= torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    probs = sorted_logits.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    remove |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    remove |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]] | None = None,
           raw_logits: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [R, V] in the model's dtype: one row per request in the same order, or, with drafts,
    1 + len(drafts[i]) consecutive rows for request i. raw_logits: the model's own where logits had
    grammars' masks applied (the logprobs are reported from them).

    Greedy rows take the argmax of the logits as they are (for bf16 that is the same token as the
    argmax of their float32 copy); only rows that transform or sample are widened to float32."""
    drafts = drafts or [[] for _ in requests]
    rows: list[Row] = [r if j == 0 else DraftRow(r, d, j) for r, d in zip(requests, drafts, strict=True)
                       for j in range(len(d) + 1)]
    params = [r.sampling_params for r in rows]
    raw_logits = logits if raw_logits is None else raw_logits
    if any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
           for p in params):
        logits = logits.to(torch.float32, copy=True)
        _mask_min_tokens(logits, rows)
        logits = _penalise(logits, rows)
    if any(p.logit_bias for p in params):
        if logits is raw_logits:  # (masked logits are already a copy)
            logits = logits.to(torch.float32, copy=True)
        _add_logit_bias(logits, params)

    tokens = fused.argmax(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        sub = logits[idx].float()
        sub_params = [params[i] for i in random_rows]
        temps = torch.tensor([p.temperature for p in sub_params], dtype=sub.dtype).unsqueeze(1)
        sub = sub / temps
        if any(p.top_k or p.top_p < 1 or p.min_p for p in sub_params):
            sub = _filter(sub, torch.tensor([p.top_k for p in sub_params]),
                          torch.tensor([p.top_p for p in sub_params], dtype=sub.dtype),
                          torch.tensor([p.min_p for p in sub_params], dtype=sub.dtype))
        probs = sub.softmax(-1)
        noise = torch.empty_like(probs)
        for n, i in enumerate(random_rows):
            seed = params[i].seed
            gen = None if seed is None else position_generator(seed, rows[i].num_output_tokens)
            noise[n].exponential_(generator=gen)
        tokens[idx] = (probs / noise).argmax(-1)

    row_tokens = tokens.tolist()
    token_ids: list[list[int]] = []
    kept_rows: list[int] = []
    first = 0
    for d in drafts:
        j = 0
        while j < len(d) and row_tokens[first + j] == d[j]:
            j += 1
        token_ids.append(row_tokens[first:first + j + 1])
        kept_rows.extend(range(first, first + j + 1))
        first += len(d) + 1
    return SamplerOutput(token_ids, _logprobs(raw_logits, params, row_tokens, kept_rows, drafts))


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Each row's logit_bias added to its logits, in place (a verification row gets its request's)."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], tops: list[int]) -> list[SampleLogprobs]:
    """logits [R, V]: row i's logprob of token_ids[i], its rank, and its top tops[i] tokens."""
    lp = logits.float().log_softmax(-1)
    k = max(tops, default=0)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    targets = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, targets)
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    return [SampleLogprobs(t, values[i], ranks[i], top_ids[i, :tops[i]].tolist(), top_vals[i, :tops[i]].tolist())
            for i, t in enumerate(token_ids)]


def _logprobs(raw_logits: torch.Tensor, params: list[SamplingParams], row_tokens: list[int], kept_rows: list[int],
              drafts: list[list[int]]) -> list[list[SampleLogprobs] | None]:
    """Logprobs of the model's distribution at each emitted token, before any sampling
    transformation (as vLLM reports)."""
    want = [i for i in kept_rows if params[i].logprobs is not None]
    by_row: dict[int, SampleLogprobs] = {}
    if want:
        scored = token_logprobs(raw_logits[want], [row_tokens[i] for i in want],
                                [params[i].logprobs or 0 for i in want])
        by_row = dict(zip(want, scored, strict=True))
    out: list[list[SampleLogprobs] | None] = []
    first = 0
    for d in drafts:
        rows = [i for i in range(first, first + len(d) + 1) if i in by_row]
        out.append([by_row[i] for i in rows] if rows else None)
        first += len(d) + 1
    return out
