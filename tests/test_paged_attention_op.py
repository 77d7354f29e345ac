"""Paged decode attention: compiled kernel and PyTorch fallback against a naive float64 reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.ops import extension as ext
from tandem.ops import paged_attention as pa

Impl = Callable[..., torch.Tensor]


def _kernel_impl() -> Impl:
    if not ext.extension_available():
        reason = "TANDEM_DISABLE_KERNELS is set" if ext.kernels_disabled() else ext.extension_error()
        pytest.skip(f"compiled ops unavailable: {reason}")
    op = ext.op("paged_decode_attention")
    assert op is not None
    return lambda *args: op(*args[:-1], float(args[-1]))


@pytest.fixture(params=["kernel", "torch"])
def impl(request: pytest.FixtureRequest) -> Impl:
    if request.param == "kernel":
        return _kernel_impl()
    return pa.paged_decode_attention_torch


def make_case(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    pad_value: int = -1,
) -> tuple[torch.Tensor, ...]:
    """Random q and K/V pool, each sequence's blocks scattered randomly through the pool."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # extra padded columns, as a real block table would have
    num_blocks = sum(blocks_per_seq) + 7  # spare blocks so the pool is not just the used ones
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def naive_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per-sequence, per-head explicit softmax(q K^T * scale) V in float64."""
    n, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = h // kvh
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        length = int(seq_lens[i])
        nb = math.ceil(length / block_size)
        ids = [int(b) for b in block_tables[i, :nb]]
        k = torch.cat([k_cache[b] for b in ids])[:length].double()  # [L, KVH, D]
        v = torch.cat([v_cache[b] for b in ids])[:length].double()
        for head in range(h):
            kv = head // group
            scores = (k[:, kv, :] @ q[i, head].double()) * scale
            p = torch.exp(scores - scores.max())
            out[i, head] = (p / p.sum()) @ v[:, kv, :]
    return out


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (seq_lens, heads, kv_heads, head_dim, block_size)
CASES = [
    ([1, 16, 17, 5, 40, 33], 4, 4, 64, 16),  # GQA 1; 1 token, exactly a block, non-multiples
    ([1, 16, 31, 100, 64], 9, 3, 64, 16),  # GQA 3, SmolLM2 heads
    ([1, 32, 33, 70], 8, 2, 128, 32),  # GQA 4, D=128, block 32
    ([1000, 3], 9, 3, 64, 16),  # long sequence (split across threads) next to a tiny one
    ([1000], 8, 2, 128, 32),  # batch 1, long: the split-and-merge path alone
    ([15, 250, 1], 4, 1, 64, 16),  # all heads on one kv head (MQA)
    ([1, 50, 300], 14, 2, 64, 16),  # GQA 7: head group split into register chunks of 4 + 3
    ([1, 7, 8, 9, 300], 4, 2, 64, 8),  # blocks smaller than the 16-token vector
    ([1, 2, 3, 45], 2, 1, 64, 1),  # one-token blocks: every block has an odd count
    ([1, 20, 129], 4, 2, 80, 16),  # D not a multiple of 32, runtime head_dim path
    ([3, 40], 2, 2, 16, 16),  # smallest head_dim
]


CASE_IDS = [f"L{max(c[0])}x{len(c[0])}-H{c[1]}-KV{c[2]}-D{c[3]}-B{c[4]}" for c in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_naive_reference(impl: Impl, case: tuple, dtype: torch.dtype) -> None:
    seq_lens, heads, kv_heads, head_dim, block_size = case
    args = make_case(seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = impl(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    ref = naive_reference(*args, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_large_scores_stay_finite(impl: Impl) -> None:
    # Big logits exercise the running-max rescaling: a naive exp would overflow.
    args = make_case([300, 17], 6, 2, 64, 16, torch.float32, seed=3)
    q = args[0] * 40.0
    out = impl(q, *args[1:], 1.0)
    ref = naive_reference(q, *args[1:], 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_padding_entries_are_ignored(impl: Impl) -> None:
    # Whatever sits past a sequence's last block (stale ids, huge values) must not matter.
    args = make_case([20, 47], 4, 2, 64, 16, torch.float32, seed=5)
    bt = args[3]
    bt_junk = bt.clone()
    bt_junk[0, 2:] = 10**6
    bt_junk[1, 3:] = 0
    out = impl(*args[:3], bt_junk, args[4], 0.125)
    torch.testing.assert_close(out, impl(*args, 0.125), atol=0, rtol=0)


def test_noncontiguous_query(impl: Impl) -> None:
    args = make_case([40, 9], 4, 2, 64, 16, torch.float32, seed=7)
    qkv = torch.randn(2, 12, 64)
    q = qkv[:, 2:6]  # a slice of a fused projection, as a model would produce
    assert not q.is_contiguous()
    out = impl(q, *args[1:], 0.125)
    torch.testing.assert_close(out.double(), naive_reference(q, *args[1:], 0.125), atol=1e-5, rtol=1e-5)


def test_kernel_thread_count_invariant() -> None:
    op = _kernel_impl()
    args = make_case([700, 5, 33], 9, 3, 64, 16, torch.bfloat16, seed=11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = op(*args, 0.125)
        torch.set_num_threads(max(2, before))
        multi = op(*args, 0.125)
    finally:
        torch.set_num_threads(before)
    # Splitting a long sequence across threads only changes float summation order.
    torch.testing.assert_close(single.float(), multi.float(), atol=1e-2, rtol=1e-2)


def test_kernel_rejects_bad_block_id() -> None:
    op = _kernel_impl()
    args = make_case([20], 2, 1, 64, 16, torch.float32)
    bt = args[3].clone()
    bt[0, 1] = args[1].shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        op(*args[:3], bt, args[4], 0.125)


def test_dispatch_uses_kernel_and_env_disables_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_impl()
    args = make_case([33, 5], 4, 2, 64, 16, torch.float32, seed=2)
    calls: list[int] = []
    real_torch = pa.paged_decode_attention_torch

    def spy(*a: torch.Tensor | float) -> torch.Tensor:
        calls.append(1)
        return real_torch(*a)

    monkeypatch.setattr(pa, "paged_decode_attention_torch", spy)
    out_kernel = pa.paged_decode_attention(*args, 0.125)
    assert not calls
    monkeypatch.setenv("TANDEM_DISABLE_KERNELS", "1")
    assert not ext.extension_available()
    out_fallback = pa.paged_decode_attention(*args, 0.125)
    assert calls
    torch.testing.assert_close(out_kernel, out_fallback, atol=1e-5, rtol=1e-5)


def test_dispatch_falls_back_for_unsupported_head_dim() -> None:
    args = make_case([20, 3], 4, 2, 24, 16, torch.float32)  # D=24 is not a multiple of 16
    out = pa.paged_decode_attention(*args, 0.2)
    torch.testing.assert_close(out.double(), naive_reference(*args, 0.2), atol=1e-5, rtol=1e-5)


def test_failed_build_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A broken toolchain must produce a warning and the fallback, never an exception.
    monkeypatch.setattr(ext, "_loaded", False)
    monkeypatch.setattr(ext, "_build_failed", None)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # empty cache: forces a build
    monkeypatch.delenv("TANDEM_DISABLE_KERNELS", raising=False)

    def broken_build(directory: Path) -> Path:
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(ext, "_build", broken_build)
    assert not ext.load_extension()
    assert "compiler exploded" in (ext.extension_error() or "")
    assert not ext.load_extension(build=False)  # not retried
    assert ext.op("paged_decode_attention") is None
    args = make_case([10], 2, 1, 64, 16, torch.float32)
    torch.testing.assert_close(
        pa.paged_decode_attention(*args, 0.125).double(), naive_reference(*args, 0.125), atol=1e-5, rtol=1e-5
    )


def test_kernel_out_variant_writes_only_its_rows() -> None:
    # The model hands the kernel q as a view of the fused qkv projection and a slice of the step's
    # output: the result must equal the plain call's, and the rows around the slice stay untouched.
    _kernel_impl()
    args = make_case([37, 300, 5], 9, 3, 64, 16, torch.bfloat16, seed=13)
    qkv = torch.randn(3, 15 * 64).to(torch.bfloat16)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    assert not q.is_contiguous()
    buf = torch.full((5, 9, 64), 7.0, dtype=torch.bfloat16)
    res = pa.paged_decode_attention(q, *args[1:], 0.125, out=buf[1:4])
    assert res.data_ptr() == buf[1:4].data_ptr()
    torch.testing.assert_close(buf[1:4], pa.paged_decode_attention(q.contiguous(), *args[1:], 0.125), atol=0, rtol=0)
    assert (buf[0] == 7).all() and (buf[4] == 7).all()
    with pytest.raises(RuntimeError, match="out must be"):
        pa.paged_decode_attention(q, *args[1:], 0.125, out=buf[:2])
