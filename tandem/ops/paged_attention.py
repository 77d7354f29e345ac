"""Paged attention kernels (``paged_attention.cpp``: decode, ``paged_prefill.cpp``: prefill) and
the write of new K/V into the pool (``kv_write.cpp``).

``paged_decode_attention`` uses the decode kernel when the extension is available (see
``tandem.ops.extension``) and the inputs suit it, and ``paged_decode_attention_torch`` otherwise.
``paged_prefill_attention`` is the kernel only: callers check ``prefill_kernel_supports`` and keep
their own batched fallback (``tandem.model.attention`` builds it once per step, not per layer).
"""

from __future__ import annotations

import functools

import torch

from tandem.kv.layout import is_quantized, quantize_rows, readable
from tandem.ops import extension

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _fake_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


extension.register_fake("paged_decode_attention", _fake_decode)


def _fake_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                  softcap: float = 0.0) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


extension.register_fake("paged_prefill_attention", _fake_prefill)


def _fake_out(*args: object, out: torch.Tensor) -> torch.Tensor:
    return out


def _fake_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    return None


extension.register_fake("paged_decode_attention.out", _fake_out)
extension.register_fake("paged_prefill_attention.out", _fake_out)
extension.register_fake("write_kv", _fake_write_kv)


def _kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, int8_cache: bool = False) -> bool:
    cache_dtypes = (q.dtype, torch.int8) if int8_cache else (q.dtype,)
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in _SUPPORTED_DTYPES
        and k_cache.dtype in cache_dtypes
        and v_cache.dtype == k_cache.dtype
        and q.shape[-1] % 16 == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and not (torch.is_grad_enabled() and q.requires_grad)  # the kernel has no backward
    )


def prefill_kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when paged_prefill_attention can serve these inputs (loads the extension if needed).
    The prefill kernel is built for AVX512 and AVX2 + FMA; a portable build leaves prefill to the caller's
    fallback. It reads caches in q's dtype only (an int8 pool's blocks are dequantized for it by the caller)."""
    return (_kernel_supports(q, k_cache, v_cache) and extension.op("paged_prefill_attention") is not None
            and _built_with_prefill_tiles())


@functools.cache
def _built_with_prefill_tiles() -> bool:
    return extension.extension_isa() in ("avx2", "avx512f", "avx512-bf16")


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of several new tokens per sequence over their paged K/V (already written).

    q: [T, H, D], sequence n's queries are rows query_start[n]:query_start[n + 1] (int32 [N + 1]);
    seq_lens: int32 [N], context plus new tokens, so query i of sequence n is at position
    seq_lens[n] - q_len + i and sees keys [0, that position], or with window > 0 its last `window`
    keys (a sliding-window layer); softcap > 0 caps the scaled scores at softcap * tanh(s / softcap).
    block_tables: int32 [N, max_blocks].
    Returns [T, H, D] in q's dtype, written into ``out`` (contiguous, q's shape) when given.
    q may be a view with token rows any distance apart (heads packed). Requires
    prefill_kernel_supports(q, k_cache, v_cache).
    """
    op = extension.op("paged_prefill_attention")
    if op is None:
        raise RuntimeError(f"paged prefill kernel unavailable: {extension.extension_error() or 'disabled'}")
    args = (q, k_cache, v_cache, block_tables, query_start, seq_lens, float(scale), int(window), float(softcap))
    return op(*args) if out is None else op.out(*args, out=out)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V.

    q: [N, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] in q's dtype, or int8 rows
    [..., D + 4] with their scales (tandem/kv/layout.py), H % KVH == 0; block_tables: int32
    [N, max_blocks]; seq_lens: int32 [N], each >= 1. Returns [N, H, D] in q's dtype.
    Query head h reads kv head h // (H // KVH). The softmax is computed in float32. The result is
    written into ``out`` (contiguous, q's shape and dtype) when given. window > 0: the query sees its
    sequence's last `window` keys only; softcap > 0: scores are capped (see paged_prefill_attention);
    sinks (float32 [H]): each head's sink logit joins the softmax's denominator and attends to nothing
    (gpt-oss), so a head may give every key little weight.
    """
    if _kernel_supports(q, k_cache, v_cache, int8_cache=True):
        op = extension.op("paged_decode_attention")
        if op is not None:
            tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)  # no-ops when int32
            args = (q, k_cache, v_cache, tables, lens, float(scale), int(window), float(softcap),
                    None if sinks is None else sinks.float().contiguous())
            return op(*args) if out is None else op.out(*args, out=out)
    res = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)
    return res if out is None else out.copy_(res)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V ([T, KVH, D], possibly strided views of a qkv projection) at
    their flat pool slots (int64 [T]) of k_cache and v_cache ([num_blocks, block_size, KVH, D], or
    int8 rows [..., D + 4]: each row quantized with its own scale)."""
    if (k.device.type == "cpu" and k_cache.device.type == "cpu" and k.dtype == v.dtype
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, torch.int8)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and all(x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] for x in (k, v))
            and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
            and (op := extension.op("write_kv")) is not None):
        op(k, v, k_cache, v_cache, slot_mapping)
        return
    kvh, row = k_cache.shape[-2:]
    if is_quantized(k_cache):
        k, v = quantize_rows(k), quantize_rows(v)
    k_cache.view(-1, kvh, row).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, row).index_copy_(0, slot_mapping, v)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch reference path: one padded gather through the block tables, then masked SDPA."""
    n, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    max_blocks = max(1, -(-int(lens.max()) // block_size)) if n else 1
    table = block_tables[:, :max_blocks].to(device=q.device, dtype=torch.long)
    # Entries past a sequence's last block may hold anything (-1, stale ids): point them at block 0.
    blocks_used = (lens + block_size - 1) // block_size
    table = torch.where(torch.arange(max_blocks, device=q.device) < blocks_used[:, None], table, 0)
    length = max_blocks * block_size
    # [N, blocks, BS, KVH, D] -> [N, KVH, L, D]
    k = readable(k_cache[table], q.dtype).reshape(n, length, kvh, d).transpose(1, 2)
    v = readable(v_cache[table], q.dtype).reshape(n, length, kvh, d).transpose(1, 2)
    keys = torch.arange(length, device=q.device)
    mask = keys < lens[:, None]
    if window > 0:
        mask &= keys >= lens[:, None] - window
    # enable_gqa reads each kv head once for its query group (2x faster than repeat_interleave);
    # SDPA's CPU kernels accumulate the softmax in float32 for bf16 inputs.
    return attention_math(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap, sinks=sinks).squeeze(2)


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   softcap: float = 0.0, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [B, H, Q, D] x [B, KVH, L, D] (mask: bool, True = attend), or its arithmetic
    written out when scores are soft-capped or a sink logit per head (sinks [H]) joins each softmax's
    denominator, which SDPA cannot do (float32 softmax)."""
    gqa = k.shape[1] != q.shape[1]
    if softcap <= 0 and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                is_causal=is_causal, enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ v.float()).to(q.dtype)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # the sink's share is dropped
    return (probs @ v.float()).to(q.dtype)
