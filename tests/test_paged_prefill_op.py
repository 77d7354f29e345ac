"""Paged prefill attention kernel: variable-length causal attention from the KV pool, against a
naive float64 reference that gathers each sequence's keys and loops over its queries."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import extension
from tandem.ops import paged_attention as pa


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if not extension.extension_available():
        pytest.skip(f"compiled ops unavailable: {extension.extension_error() or 'disabled'}")
    if not pa._built_with_prefill_tiles():
        pytest.skip(f"the prefill kernel needs AVX512 or AVX2; this build is {extension.extension_isa()} (SDPA)")


def make_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """seqs: (context, q_len) per sequence; blocks are scattered through a pool with spare blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_blocks = max(blocks_per_seq) + 2  # columns past a sequence's blocks hold junk
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    query_start = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    q = torch.randn(int(q_lens.sum()), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, query_start, seq_lens


def naive_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    bs = k_cache.shape[1]
    for n in range(len(seq_lens)):
        start, end, length = int(query_start[n]), int(query_start[n + 1]), int(seq_lens[n])
        pos = torch.arange(length)
        slots = tables[n].long()[pos // bs] * bs + pos % bs
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()  # [L, KVH, D]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        context = length - (end - start)
        for i in range(end - start):
            visible = context + i + 1
            for h in range(q.shape[1]):
                s = keys[:visible, h // group] @ q[start + i, h].double() * scale
                out[start + i, h] = s.softmax(0) @ values[:visible, h // group]
    return out


CASES = {
    "fresh prompts": [(0, 37), (0, 1), (0, 16), (0, 70)],
    "chunks after context": [(16, 16), (5, 23), (100, 3), (31, 1)],
    "mixed": [(0, 40), (48, 17), (0, 2), (7, 33)],
    "long": [(200, 312), (0, 300)],  # several softmax chunks, the diagonal inside a later one
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 5), (8, 2, 128, 16), (6, 2, 48, 16)])  # 48: bf16 tiles
def test_kernel_matches_reference(case: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                  block_size: int) -> None:
    args = make_case(CASES[case], heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim ** -0.5
    assert pa.prefill_kernel_supports(args[0], args[1], args[2])
    out = pa.paged_prefill_attention(*args, scale)
    assert out.dtype == dtype and out.shape == args[0].shape
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), naive_reference(*args, scale), **tol)


def test_bad_block_id_raises() -> None:
    q, k, v, tables, qs, lens = make_case([(0, 20)], 2, 1, 64, 16, torch.float32)
    tables[0, 1] = k.shape[0] + 3
    with pytest.raises(RuntimeError, match="out of range"):
        pa.paged_prefill_attention(q, k, v, tables, qs, lens, 0.125)
    tables[0, 1] = 0
    with pytest.raises(RuntimeError, match="queries but seq_len"):
        pa.paged_prefill_attention(q, k, v, tables, qs, torch.tensor([10], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 48)],
                         ids=["brgemm", "f32-tiles", "bf16-tiles"])
def test_strided_query_and_out_rows(dtype: torch.dtype, head_dim: int) -> None:
    # q as a view of a fused qkv projection, the result written into a slice of a larger output.
    q, k, v, tables, qs, lens = make_case(CASES["mixed"], 6, 2, head_dim, 16, dtype, seed=3)
    t = q.shape[0]
    qkv = torch.zeros(t, 10 * head_dim, dtype=dtype)
    qkv[:, : 6 * head_dim] = q.reshape(t, -1)
    q_view = qkv[:, : 6 * head_dim].view(t, 6, head_dim)
    assert not q_view.is_contiguous()
    buf = torch.full((t + 2, 6, head_dim), 3.0, dtype=dtype)
    pa.paged_prefill_attention(q_view, k, v, tables, qs, lens, 0.125, out=buf[2:])
    torch.testing.assert_close(buf[2:], pa.paged_prefill_attention(q, k, v, tables, qs, lens, 0.125), atol=0, rtol=0)
    assert (buf[:2] == 3).all()
