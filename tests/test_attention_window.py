"""Sliding-window and soft-capped attention (Gemma's layers) in the paged kernels and their PyTorch
fallbacks, against a naive float64 reference: each query at position p sees keys
(p - window, p] and its scores are capped at softcap * tanh(s / softcap) before the softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_paged_prefill_op import make_case

from tandem.model.attention import build_attention_metadata, paged_attention
from tandem.ops import extension
from tandem.ops import paged_attention as pa


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
              softcap: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group, bs = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    for n in range(len(seq_lens)):
        start, end, length = int(query_start[n]), int(query_start[n + 1]), int(seq_lens[n])
        pos = torch.arange(length)
        slots = tables[n].long()[pos // bs] * bs + pos % bs
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        context = length - (end - start)
        for i in range(end - start):
            p = context + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(q.shape[1]):
                s = keys[lo:p + 1, h // group] @ q[start + i, h].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[start + i, h] = s.softmax(0) @ values[lo:p + 1, h // group]
    return out


def _needs_kernels(prefill: bool = False) -> None:
    if not extension.extension_available():
        pytest.skip(f"compiled ops unavailable: {extension.extension_error() or 'disabled'}")
    if prefill and not pa._built_with_prefill_tiles():
        pytest.skip("the prefill kernel needs AVX512 or AVX2")


SEQS = [(0, 45), (30, 17), (100, 3), (7, 1), (0, 130)]  # (context, new tokens)
SHAPES = [(8, 2, 64, 16), (4, 1, 256, 16), (6, 2, 48, 5)]  # brgemm (bf16), Gemma 3's 256, bf16 tiles
WINDOWS = [(9, 0.0), (64, 0.0), (0, 3.0), (20, 3.0)]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_prefill_kernel(window: int, softcap: float, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                        block_size: int) -> None:
    _needs_kernels(prefill=True)
    args = make_case(SEQS, heads, kv_heads, head_dim, block_size, dtype, seed=window + head_dim)
    scale = 2.0 * head_dim ** -0.5  # larger scores, so the cap bites
    out = pa.paged_prefill_attention(*args, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), reference(*args, scale, window, softcap), **_tol(dtype))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(kernel: bool, window: int, softcap: float, dtype: torch.dtype) -> None:
    """One query per sequence (the window starting mid-block, at a block edge, or past the start);
    long sequences are split into block ranges across threads, which must agree with the window."""
    if kernel:
        _needs_kernels()
    lens = [1, 9, 16, 17, 64, 300, 700]
    args = make_case([(n - 1, 1) for n in lens], 4, 1, 256, 16, dtype, seed=window)
    q, k, v, tables, query_start, seq_lens = args
    scale = 2.0 / 16
    fn = pa.paged_decode_attention if kernel else pa.paged_decode_attention_torch
    out = fn(q, k, v, tables, seq_lens, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), reference(*args, scale, window, softcap), **_tol(dtype))


@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_layer_fallback_matches_kernels(window: int, softcap: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention over a mixed step (decodes, fresh prompts, chunks after context): the PyTorch
    fallback's groups (causal, gathered) equal the reference as the kernels do."""
    block_size, heads, kv_heads, d = 4, 4, 2, 32
    seqs = [(12, 1), (40, 1), (0, 23), (0, 9), (17, 11)]
    q_lens = np.array([n for _, n in seqs])
    ctx = np.array([c for c, _ in seqs])
    gen = torch.Generator().manual_seed(window)
    num_blocks = 64
    tables = torch.randperm(num_blocks, generator=gen)[:len(seqs) * 12].view(len(seqs), 12).to(torch.int32).numpy()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    t = int(q_lens.sum())
    q = torch.randn(t, heads, d, generator=gen)
    k, v = torch.randn(t, kv_heads, d, generator=gen), torch.randn(t, kv_heads, d, generator=gen)
    meta = build_attention_metadata(q_lens, ctx, tables, 2, block_size, torch.device("cpu"))
    results = {}
    for mode in ("kernels", "pytorch"):
        if mode == "pytorch":
            monkeypatch.setattr("tandem.model.attention.prefill_kernel_supports", lambda *a: False)
            monkeypatch.setattr(pa, "_kernel_supports", lambda *a, **kw: False)
        kc, vc = k_cache.clone(), v_cache.clone()
        results[mode] = paged_attention(q, k, v, kc, vc, meta, 0.3, window, softcap)
    qs = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    expected = reference(q, kc, vc, torch.from_numpy(tables), qs, torch.from_numpy((ctx + q_lens).astype(np.int32)),
                         0.3, window, softcap)
    for mode, out in results.items():
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5, msg=mode)
