"""How the pool holds one token's K or V row for one kv head: in the model's dtype, or as int8.

kv_cache_dtype "auto": the pool is [layers, 2, blocks, block_size, kv_heads, head_dim] in the model's dtype.

kv_cache_dtype "int8": [..., head_dim + 4] int8. Each (token, kv head) row is head_dim int8 values
q = round(x / s) and, in its last 4 bytes, the float32 scale s = max|x| / 127 of that row. A row is
quantized once, when its token is written, and never again (a per-block scale would have to be
revised as tokens arrive, and re-round the rows already there). The scales live inside the rows, so
a block is self-contained: the disaggregated transfer and the tiered store move quantized blocks as
they are, with no second tensor to keep in step. For a head_dim of 64 that is 68 bytes a row against
256 in float32 and 128 in bfloat16.

The decode kernel reads int8 rows in place (tandem/ops/paged_attention.cpp): decode is bound by the
bytes it reads. Prompt chunks are bound by FLOPs, so their context blocks are dequantized once per
layer into the model's dtype and the usual prefill kernel runs on those (tandem/model/attention.py).
Every read goes through the rounding, the step's own new tokens included, so a prompt gives the same
attention whether it was computed in one chunk or several, with or without a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 4  # one float32 per row


class KVShape(Protocol):
    """The model dimensions a pool's size depends on besides the row (the model's ArchConfig has them):
    storage takes shapes, not the model."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...


@dataclass(frozen=True)
class KVLayout:
    dtype: torch.dtype  # of the pool's elements
    head_dim: int
    row_dim: int  # the pool's last dimension: head_dim, or head_dim + SCALE_BYTES for int8

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def bytes_per_token(self, shape: KVShape) -> int:
        """Bytes of one token's K and V in every layer."""
        return shape.num_layers * 2 * shape.num_kv_heads * self.row_dim * self.dtype.itemsize


def kv_layout(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVLayout:
    if kv_cache_dtype == "auto":
        return KVLayout(model_dtype, head_dim, head_dim)
    if kv_cache_dtype == "int8":
        return KVLayout(torch.int8, head_dim, head_dim + SCALE_BYTES)
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows with their scales (the kernels' write, in PyTorch)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv).to(torch.int8)  # |x * inv| <= 127 by construction
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] in dtype (q * s in float32, then rounded to dtype once)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def readable(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache (or a gathered part of it) as values in dtype: itself unless it is int8."""
    return dequantize_rows(cache, dtype) if is_quantized(cache) else cache
