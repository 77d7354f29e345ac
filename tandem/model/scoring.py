"""Log-likelihood of a text under a model: one prefill over a private KV pool, every position's logits.
The accuracy checks of quantized serving compare perplexities, and the distributions themselves
(next_token_logits), on the same text.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tandem.kv.layout import kv_layout
from tandem.model.attention import build_attention_metadata
from tandem.model.causal_lm import CausalLM


@torch.inference_mode()
def next_token_logits(model: CausalLM, ids: list[int], kv_cache_dtype: str = "auto",
                      block_size: int = 16) -> torch.Tensor:
    """Every position's logits for the token after it, [len(ids), vocab] in float32, with the KV held as
    kv_cache_dtype says."""
    cfg = model.cfg
    device = model.norm.weight.device
    layout = kv_layout(kv_cache_dtype, model.norm.weight.dtype, cfg.head_dim)
    num_blocks = (len(ids) + block_size - 1) // block_size
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, layout.row_dim,
                     dtype=layout.dtype, device=device)
    rows = np.arange(len(ids))
    meta = build_attention_metadata(np.array([len(ids)]), np.array([0]), np.arange(num_blocks, dtype=np.int32)[None],
                                    0, block_size, device, rows, compact_prefill_blocks=layout.quantized)
    return model(torch.tensor(ids, device=device), meta, kv, torch.from_numpy(rows).to(device)).float()


def token_logprobs(model: CausalLM, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, in float32."""
    logp = next_token_logits(model, ids, kv_cache_dtype)[:-1].log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].cpu()


def perplexity(model: CausalLM, ids: list[int], kv_cache_dtype: str = "auto") -> float:
    return math.exp(-token_logprobs(model, ids, kv_cache_dtype).mean().item())


def agreed_prefix(got: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    """(tokens before each sequence's first difference from its reference, reference tokens), summed: how
    much of a greedy run another model reproduces (after a difference the contexts differ)."""
    agreed = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                 for a, b in zip(got, reference, strict=True))
    return agreed, sum(len(b) for b in reference)
