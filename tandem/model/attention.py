"""Paged attention over a packed, variable-length batch.

The batch is ordered so that the requests with a single query token (decodes) come first and the
rest (prompt chunks, or several speculative tokens) after. Everything that depends only on the
batch's shape (slot mapping, block tables, query offsets) is built once per step by
`build_attention_metadata`; the per-layer code below is a handful of tensor ops with no Python
loop over requests.

Both kinds of query read K/V in place through the block tables when the compiled kernels serve
the inputs (CPU, float32/bfloat16): decodes with the paged decode kernel, multi-token queries with
the paged prefill kernel (causal, variable length, no padding, no mask tensor). Otherwise (another
device, kernels disabled) a PyTorch fallback runs: decodes gather their blocks into a padded batch;
multi-token queries with no cached context run as one padded causal SDPA (the flash kernel, no
mask), and those with context gather it once per layer and run masked SDPA. The fallback's index
tensors are built lazily, once per step, only when it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.kv.layout import is_quantized, quantize_rows, readable
from tandem.ops.paged_attention import (
    attention_math,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_kernel_supports,
    write_kv,
)


@dataclass
class PrefillGroup:
    """Multi-token queries run as one SDPA call over a padded [B, Q] grid of queries.

    Causal groups are requests with no cached context (whole prompts, or first chunks): their keys
    are exactly their new tokens, so plain causal attention applies and SDPA can use its flash
    kernel, with no gather and no mask. The other group attends to context in the pool: keys are
    gathered through the block table and a mask encodes causality at each query's offset."""

    tokens: torch.Tensor | None  # [Tg] this group's rows among the step's multi-token queries; None: all, in order
    scatter: torch.Tensor | None  # [Tg] each row's index in the flat [B * Q] grid; None: B == 1, no padding
    shape: tuple[int, int]  # (B, Q)
    gather: torch.Tensor | None = None  # [B, L] pool slot of every key; None for a causal group
    mask: torch.Tensor | None = None  # [B, 1, Q, L] bool, True = attend
    query_pos: torch.Tensor | None = None  # [B, 1, Q, 1] each query's position (padding: 0), for a window


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] flat slot in the pool for each new token's K/V
    num_decode_tokens: int  # the first this many tokens are single-token queries
    decode_block_tables: torch.Tensor  # [Nd, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [Nd] int32
    # Multi-token queries (the requests after the decodes):
    prefill_block_tables: torch.Tensor  # [Np, max_blocks] int32
    prefill_query_start: torch.Tensor  # [Np + 1] int32 offsets of each request's queries among them
    prefill_seq_lens: torch.Tensor  # [Np] int32 context + new tokens
    block_size: int = 16
    # An int8 pool's blocks that the multi-token queries read ([U] int64); their block tables then
    # index this list, so each layer dequantizes these blocks for the prefill kernel (layout.py).
    prefill_blocks: torch.Tensor | None = None
    # The rows sampled after the last layer ([S], the order of the logits), when that is fewer than
    # all rows: the last layer then computes attention and its MLP for these rows only (every row's
    # K/V is still written), each as a single query over its own context, with these tables.
    sampled_rows: torch.Tensor | None = None
    sampled_block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    sampled_seq_lens: torch.Tensor | None = None  # [S] int32: each row's position + 1
    # Host copies of the multi-token queries' q_lens, context_lens and block tables, from which the
    # fallback's groups are built on first use (never, when the kernel serves every layer).
    _host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    _groups: list[PrefillGroup] | None = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_seq_lens)

    def prefill_groups(self) -> list[PrefillGroup]:
        """The fallback's batching of the multi-token queries: at most two groups, causal first."""
        if self._groups is None:
            assert self._host is not None
            self._groups = _prefill_groups(*self._host, self.block_size, self.positions.device)
        return self._groups


def build_attention_metadata(q_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                             num_decodes: int, block_size: int, device: torch.device,
                             logits_indices: np.ndarray | None = None,
                             compact_prefill_blocks: bool = False) -> AttentionMetadata:
    """q_lens[b] new tokens follow context_lens[b] computed ones; decodes (q_len 1) come first.
    logits_indices: the rows whose logits the step needs (None: all of them).
    compact_prefill_blocks: number the multi-token queries' blocks 0..U-1 (prefill_blocks)."""
    if num_decodes == len(q_lens) and (logits_indices is None or len(logits_indices) == num_decodes):
        return _decode_metadata(context_lens, block_tables, block_size, device)
    seq_lens = context_lens + q_lens
    req_idx = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = token_positions(q_lens, context_lens)
    slots = block_tables[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    bt = torch.from_numpy(block_tables)
    prefill_query_start = np.zeros(len(q_lens) - num_decodes + 1, dtype=np.int32)
    np.cumsum(q_lens[num_decodes:], out=prefill_query_start[1:])
    prefill_tables, prefill_blocks = block_tables[num_decodes:], None
    if compact_prefill_blocks and len(prefill_tables):
        used, local = np.unique(prefill_tables, return_inverse=True)
        prefill_tables = local.reshape(prefill_tables.shape).astype(np.int32)
        prefill_blocks = torch.from_numpy(used.astype(np.int64)).to(device)
    sampled: dict[str, torch.Tensor] = {}
    if logits_indices is not None and len(logits_indices) < len(positions):
        rows = np.asarray(logits_indices, dtype=np.int64)
        sampled = dict(sampled_rows=torch.from_numpy(rows).to(device),
                       sampled_block_tables=bt[req_idx[rows]].to(device),
                       sampled_seq_lens=torch.from_numpy((positions[rows] + 1).astype(np.int32)).to(device))
    return AttentionMetadata(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode_tokens=num_decodes,
        decode_block_tables=bt[:num_decodes].to(device),
        decode_seq_lens=torch.from_numpy(seq_lens[:num_decodes].astype(np.int32)).to(device),
        prefill_block_tables=torch.from_numpy(prefill_tables).to(device),
        prefill_query_start=torch.from_numpy(prefill_query_start).to(device),
        prefill_seq_lens=torch.from_numpy(seq_lens[num_decodes:].astype(np.int32)).to(device),
        block_size=block_size,
        prefill_blocks=prefill_blocks,
        **sampled,
        _host=(q_lens[num_decodes:], context_lens[num_decodes:], prefill_tables),
    )


_NO_PREFILLS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _decode_metadata(context_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                     device: torch.device) -> AttentionMetadata:
    """A step of decodes only, every row sampled (most steps): each new token sits at its context's
    length. The same metadata as the general path, in a third of its host operations (each one costs
    microseconds on caches the forward pass has just flushed)."""
    n = len(context_lens)
    slots = block_tables[np.arange(n), context_lens // block_size].astype(np.int64)
    slots *= block_size
    slots += context_lens % block_size
    bt = torch.from_numpy(block_tables).to(device)
    if device not in _NO_PREFILLS:  # read-only inputs of the kernels: shared by every such step
        _NO_PREFILLS[device] = (torch.zeros(1, dtype=torch.int32, device=device),
                                torch.zeros(0, dtype=torch.int32, device=device))
    query_start, seq_lens = _NO_PREFILLS[device]
    return AttentionMetadata(
        positions=torch.from_numpy(context_lens).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode_tokens=n,
        decode_block_tables=bt,
        decode_seq_lens=torch.from_numpy((context_lens + 1).astype(np.int32)).to(device),
        prefill_block_tables=bt[:0],
        prefill_query_start=query_start,
        prefill_seq_lens=seq_lens,
        block_size=block_size,
        _host=(context_lens[:0], context_lens[:0], block_tables[:0]),
    )


def _prefill_groups(pq: np.ndarray, pc: np.ndarray, block_tables: np.ndarray, block_size: int,
                    device: torch.device) -> list[PrefillGroup]:
    groups = []
    row_of_token = np.repeat(np.arange(len(pq)), pq)
    fresh = pc == 0
    for rows, causal in ((np.flatnonzero(fresh), True), (np.flatnonzero(~fresh), False)):
        if not len(rows):
            continue
        tokens = None
        if len(rows) < len(pq):
            tokens = torch.from_numpy(np.flatnonzero(np.isin(row_of_token, rows))).to(device)
        groups.append(_padded_group(pq[rows], pc[rows], block_tables[rows], tokens, causal, block_size, device))
    return groups


def _padded_group(q_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                  tokens: torch.Tensor | None, causal: bool, block_size: int, device: torch.device) -> PrefillGroup:
    b, q = len(q_lens), int(q_lens.max())
    # Row i's queries go to i * Q + their index within the chunk.
    scatter = None
    if b > 1:
        scatter = torch.from_numpy(np.repeat(np.arange(b) * q, q_lens)
                                   + token_positions(q_lens, np.zeros_like(q_lens))).to(device)
    group = PrefillGroup(tokens, scatter, (b, q))
    if causal:
        return group
    seq_lens = context_lens + q_lens
    lk = int(seq_lens.max())
    key_pos = np.arange(lk)
    valid_key = key_pos[None, :] < seq_lens[:, None]
    block_of_key = block_tables[:, np.minimum(key_pos // block_size, block_tables.shape[1] - 1)]
    gather = np.where(valid_key, block_of_key.astype(np.int64) * block_size + key_pos % block_size, 0)
    query_pos = context_lens[:, None] + np.arange(q)[None, :]  # absolute position of each padded query
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    mask &= (np.arange(q)[None, :] < q_lens[:, None])[:, :, None]
    mask[:, :, 0] = True  # padded query rows attend one key rather than none (avoids NaN rows)
    group.gather = torch.from_numpy(gather).to(device)
    group.mask = torch.from_numpy(mask[:, None]).to(device)
    live = np.arange(q)[None, :] < q_lens[:, None]  # padding at position 0 keeps key 0 in any window
    group.query_pos = torch.from_numpy(np.where(live, query_pos, 0)[:, None, :, None]).to(device)
    return group


def token_positions(q_lens: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    starts = np.cumsum(q_lens) - q_lens
    return np.arange(int(q_lens.sum())) - np.repeat(starts, q_lens) + np.repeat(context_lens, q_lens)


def _to_grid(x: torch.Tensor, g: PrefillGroup) -> torch.Tensor:
    """[Tg, H, D] packed rows -> [B, H, Q, D] padded grid."""
    if g.scatter is None:
        return x.transpose(0, 1).unsqueeze(0)
    b, q = g.shape
    grid = x.new_zeros(b * q, *x.shape[1:])
    grid[g.scatter] = x
    return grid.view(b, q, *x.shape[1:]).transpose(1, 2)


def _from_grid(out: torch.Tensor, g: PrefillGroup) -> torch.Tensor:
    """[B, H, Q, D] -> [Tg, H, D] packed rows."""
    if g.scatter is None:
        return out.squeeze(0).transpose(0, 1)
    b, h, q, d = out.shape
    return out.transpose(1, 2).reshape(b * q, h, d)[g.scatter]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens; returns [T, H, D]. window > 0: each query
    sees its last `window` keys (a sliding-window layer); softcap > 0: scores are soft-capped; sinks
    (float32 [H]): each head's sink logit joins its softmax's denominator (gpt-oss)."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    # Both kernels write their rows of one output, so the halves are never concatenated.
    out = q.new_empty(q.shape)
    nd = meta.num_decode_tokens
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                               out=out[:nd], window=window, softcap=softcap, sinks=sinks)
    if meta.num_prefills:
        qp = q[nd:]
        quantized = is_quantized(k_cache)
        if quantized:
            # Prompt chunks are bound by FLOPs, not bytes: the blocks they read, dequantized once a layer.
            assert meta.prefill_blocks is not None, "an int8 pool needs compact_prefill_blocks metadata"
            k_cache, v_cache = (readable(c[meta.prefill_blocks], q.dtype) for c in (k_cache, v_cache))
        if sinks is None and prefill_kernel_supports(qp, k_cache, v_cache):  # the prefill kernels have no sinks
            paged_prefill_attention(qp, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                                    meta.prefill_seq_lens, scale, out=out[nd:], window=window, softcap=softcap)
        else:
            kp, vp = k[nd:], v[nd:]
            if quantized:  # the fallback's causal group reads the new rows directly: as the pool holds them
                kp, vp = (readable(quantize_rows(x), q.dtype) for x in (kp, vp))
            num_kv_heads, head_dim = k_cache.shape[-2:]
            k_flat = k_cache.view(-1, num_kv_heads, head_dim)
            v_flat = v_cache.view(-1, num_kv_heads, head_dim)
            out[nd:] = _prefill_attention_torch(qp, kp, vp, k_flat, v_flat, meta.prefill_groups(), scale,
                                                window, softcap, sinks)
    return out


def paged_attention_sampled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0,
                            softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Like paged_attention, but the output holds only meta.sampled_rows: [S, H, D]. Every row's K/V
    goes into the pool; each sampled row attends as one query over keys [0, its position]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert meta.sampled_rows is not None and meta.sampled_block_tables is not None
    if not len(meta.sampled_rows):
        return q.new_empty(0, *q.shape[1:])
    return paged_decode_attention(q[meta.sampled_rows], k_cache, v_cache, meta.sampled_block_tables,
                                  meta.sampled_seq_lens, scale, window=window, softcap=softcap, sinks=sinks)


def _prefill_attention_torch(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, k_flat: torch.Tensor,
                             v_flat: torch.Tensor, groups: list[PrefillGroup], scale: float, window: int,
                             softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = qp.new_empty(qp.shape) if len(groups) > 1 else None
    for g in groups:  # one or two groups, whatever the number of requests
        qg = qp if g.tokens is None else qp[g.tokens]
        if g.gather is None:
            kg = kp if g.tokens is None else kp[g.tokens]
            vg = vp if g.tokens is None else vp[g.tokens]
            mask = None
            if window > 0:  # causal within the window: keys (i - window, i]
                mask = torch.ones(g.shape[1], g.shape[1], dtype=torch.bool, device=qp.device).tril()
                mask &= ~mask.tril(-window)
            res = attention_math(_to_grid(qg, g), _to_grid(kg, g), _to_grid(vg, g), mask, scale, softcap,
                                 is_causal=mask is None, sinks=sinks)
        else:
            keys = k_flat[g.gather].transpose(1, 2)  # [B, KVH, L, D]
            values = v_flat[g.gather].transpose(1, 2)
            mask = g.mask
            if window > 0:
                assert mask is not None and g.query_pos is not None
                mask = mask & (torch.arange(mask.shape[-1], device=qp.device) > g.query_pos - window)
            res = attention_math(_to_grid(qg, g), keys, values, mask, scale, softcap, sinks=sinks)
        res = _from_grid(res, g)
        if out is None:
            out = res
        else:
            out[g.tokens] = res
    assert out is not None
    return out
