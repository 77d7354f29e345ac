"""Fused elementwise ops: each compiled kernel against its PyTorch fallback (the reference ops)."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import extension, fused

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if not extension.extension_available():
        pytest.skip(f"compiled ops unavailable: {extension.extension_error() or 'disabled'}")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # One bf16 ulp where a sum's order or an exp differs; float32 to rounding.
    tol = dict(atol=1e-2, rtol=1e-2) if actual.dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 40])  # 40: a tail shorter than one vector
def test_rms_norm_and_residual_add(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(37, hidden, generator=g).to(dtype)
    w = torch.rand(hidden, generator=g).to(dtype) + 0.5
    _close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_torch(x, w, 1e-5))
    res_before = res.clone()
    out, new_res = fused.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = fused.add_rms_norm_torch(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact
    _close(out, ref_out)
    assert torch.equal(res, res_before)  # the residual input is not modified in place
    # 3-D input (Qwen3's per-head q/k norm) normalises the last dimension.
    x3 = x.view(37, -1, hidden // 4 if hidden % 4 == 0 else hidden)
    w3 = w[:x3.shape[-1]].contiguous()
    _close(fused.rms_norm(x3, w3, 1e-6), fused.rms_norm_torch(x3, w3, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 32, 24])  # 24: the scalar path
def test_rotary_in_place_on_strided_views_matches_reference(dtype: torch.dtype, head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 11, 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    ref_q, ref_k = fused.rotary_torch(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    out_q, out_k = fused.rotary(q, k, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)  # same rounding steps: bit-exact
    assert torch.equal(v, v_before)  # the kernel wrote only q and k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = (torch.randn(19, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and signed-zero gates
    _close(fused.silu_and_mul(x), fused.silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_argmax_first_maximum(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(23, vocab, generator=g).to(dtype)
    x[1] = -5.0  # all equal and negative: index 0 (masked tail lanes must not win as zeros)
    x[2, vocab // 2] = x[2, -1] = 100.0  # a tie: the first occurrence
    x[3, -1] = 1e4  # the maximum in the tail
    x[4] = float("-inf")
    x[4, vocab - 1] = -1e30
    assert torch.equal(fused.argmax(x), x.argmax(-1))
    assert torch.equal(fused.argmax(x[:, : vocab - 1]), x[:, : vocab - 1].argmax(-1))  # strided rows


def test_fallback_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    monkeypatch.setenv("TANDEM_DISABLE_KERNELS", "1")
    assert extension.op("rms_norm") is None
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_torch(x, w, 1e-5))
    assert torch.equal(fused.argmax(x), x.argmax(-1))
