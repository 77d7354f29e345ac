"""Logits -> tokens, with per-request parameters, vectorised over the batch.

Random sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), which lets a
seeded request draw its noise from its own generator: its tokens do not depend on what else is
in the batch. Greedy requests skip all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.request import Request
from tandem.ops import fused


@dataclass
class SampleLogprobs:
    token_id: int
    token_logprob: float
    token_rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


def _penalise(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
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


def _mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            stops = list(p.stop_token_ids)
            if r.eos_token_id is not None and not p.ignore_eos:
                stops.append(r.eos_token_id)
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


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: [B, V] in the model's dtype, one row per request in the same order.

    Greedy rows take the argmax of the logits as they are (for bf16 that is the same token as the
    argmax of their float32 copy); only rows that transform or sample are widened to float32."""
    params = [r.sampling_params for r in requests]
    raw_logits = logits
    if any(p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
           for p in params):
        logits = logits.to(torch.float32, copy=True)
        _mask_min_tokens(logits, requests)
        logits = _penalise(logits, requests)

    greedy = [p.greedy for p in params]
    tokens = fused.argmax(logits)
    if not all(greedy):
        idx = torch.tensor([i for i, g in enumerate(greedy) if not g])
        sub = logits[idx].float()
        sub_params = [params[i] for i in idx.tolist()]
        temps = torch.tensor([p.temperature for p in sub_params], dtype=sub.dtype).unsqueeze(1)
        sub = sub / temps
        if any(p.top_k or p.top_p < 1 or p.min_p for p in sub_params):
            sub = _filter(sub, torch.tensor([p.top_k for p in sub_params]),
                          torch.tensor([p.top_p for p in sub_params], dtype=sub.dtype),
                          torch.tensor([p.min_p for p in sub_params], dtype=sub.dtype))
        probs = sub.softmax(-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(idx.tolist()):
            noise[row].exponential_(generator=requests[i].generator)
        tokens[idx] = (probs / noise).argmax(-1)

    token_list = tokens.tolist()
    logprobs: list[SampleLogprobs | None] = [None] * len(requests)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # Logprobs of the model's distribution, before any sampling transformation (as vLLM reports).
        lp = raw_logits[want].float().log_softmax(-1)
        k = max(params[i].logprobs or 0 for i in want)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        for row, i in enumerate(want):
            n = params[i].logprobs or 0
            token_lp = lp[row, token_list[i]]
            rank = int((lp[row] > token_lp).sum().item()) + 1
            logprobs[i] = SampleLogprobs(token_list[i], token_lp.item(), rank, top_ids[row, :n].tolist(),
                                         top_vals[row, :n].tolist())
    return SamplerOutput(token_list, logprobs)
