"""Paged attention over a packed, variable-length batch.

The batch is ordered so that the requests with a single query token (decodes) come first and the
rest (prompt chunks, or several speculative tokens) after. Everything that depends only on the
batch's shape (slot mapping, gather indices, masks) is built once per step by
`build_attention_metadata`; the per-layer code below is a handful of tensor ops with no Python
loop over requests.

Decodes read K/V in place through the block table (a C++ kernel when built, else a padded gather).
Multi-token queries gather their context once per layer and run masked SDPA, which uses the
matmul units; that path is compute-bound, so the gather's extra copy costs little there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.ops.paged_attention import paged_decode_attention


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] flat slot in the pool for each new token's K/V
    num_decode_tokens: int  # the first this many tokens are single-token queries
    decode_block_tables: torch.Tensor  # [Nd, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [Nd] int32
    # Multi-token queries, padded to [Bp, Qp] queries over [Bp, Lp] keys.
    prefill_gather: torch.Tensor | None  # [Bp, Lp] slots of every key of each request
    prefill_mask: torch.Tensor | None  # [Bp, 1, Qp, Lp] bool, True = attend
    prefill_scatter: torch.Tensor | None  # [Tp] index of each packed query in the flat [Bp*Qp] grid
    prefill_shape: tuple[int, int]  # (Bp, Qp)
    # One multi-token query with no cached context (a whole prompt, or its first chunk): plain
    # causal attention over the new K/V, no gather and no mask, which lets SDPA use its flash kernel.
    prefill_causal: bool = False


def build_attention_metadata(q_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                             num_decodes: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """q_lens[b] new tokens follow context_lens[b] computed ones; decodes (q_len 1) come first."""
    seq_lens = context_lens + q_lens
    req_idx = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = token_positions(q_lens, context_lens)
    slots = block_tables[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size

    bt = torch.from_numpy(block_tables)
    meta = AttentionMetadata(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode_tokens=num_decodes,
        decode_block_tables=bt[:num_decodes].to(device),
        decode_seq_lens=torch.from_numpy(seq_lens[:num_decodes].astype(np.int32)).to(device),
        prefill_gather=None, prefill_mask=None, prefill_scatter=None, prefill_shape=(0, 0),
    )
    if num_decodes == len(q_lens):
        return meta

    pq, pc, ps = q_lens[num_decodes:], context_lens[num_decodes:], seq_lens[num_decodes:]
    bp, qp, lp = len(pq), int(pq.max()), int(ps.max())
    if bp == 1 and pc[0] == 0:
        meta.prefill_causal = True
        return meta
    key_pos = np.arange(lp)
    valid_key = key_pos[None, :] < ps[:, None]
    gather = np.where(valid_key, block_tables[num_decodes:, np.minimum(key_pos // block_size,
                                                                       block_tables.shape[1] - 1)]
                      .astype(np.int64) * block_size + key_pos % block_size, 0)
    query_pos = pc[:, None] + np.arange(qp)[None, :]  # absolute position of each padded query
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    mask &= (np.arange(qp)[None, :] < pq[:, None])[:, :, None]
    mask[:, :, 0] = True  # padded query rows attend one key rather than none (avoids NaN rows)
    # Row b's queries go to b * Qp + their index within the chunk.
    scatter = np.repeat(np.arange(bp) * qp, pq) + token_positions(pq, np.zeros_like(pq))
    meta.prefill_gather = torch.from_numpy(gather).to(device)
    meta.prefill_mask = torch.from_numpy(mask[:, None]).to(device)
    meta.prefill_scatter = torch.from_numpy(scatter).to(device)
    meta.prefill_shape = (bp, qp)
    return meta


def token_positions(q_lens: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    starts = np.cumsum(q_lens) - q_lens
    return np.arange(int(q_lens.sum())) - np.repeat(starts, q_lens) + np.repeat(context_lens, q_lens)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens; returns [T, H, D]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    nd = meta.num_decode_tokens
    parts = []
    if nd:
        parts.append(paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_seq_lens, scale))
    if meta.prefill_causal:
        out = F.scaled_dot_product_attention(q[nd:].transpose(0, 1).unsqueeze(0), k[nd:].transpose(0, 1).unsqueeze(0),
                                             v[nd:].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != num_kv_heads)
        parts.append(out.squeeze(0).transpose(0, 1))
    elif meta.prefill_gather is not None:
        bp, qp = meta.prefill_shape
        num_heads = q.shape[1]
        qpad = q.new_zeros(bp * qp, num_heads, head_dim)
        qpad[meta.prefill_scatter] = q[nd:]
        keys = k_flat[meta.prefill_gather].transpose(1, 2)  # [Bp, KVH, Lp, D]
        values = v_flat[meta.prefill_gather].transpose(1, 2)
        out = F.scaled_dot_product_attention(qpad.view(bp, qp, num_heads, head_dim).transpose(1, 2), keys, values,
                                             attn_mask=meta.prefill_mask, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
        parts.append(out.transpose(1, 2).reshape(bp * qp, num_heads, head_dim)[meta.prefill_scatter])
    return parts[0] if len(parts) == 1 else torch.cat(parts)
