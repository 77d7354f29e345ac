"""GGUF block-quantized linear layers: the compiled kernels, their PyTorch fallbacks and an independent
reference (gguf-py's own quantizer and dequantizer, float32 matmul) agree.

Two arithmetics (tandem/model/quant.py):
- float: x times the dequantized weights, in float32. Kernel, fallback and the reference compute the
  same products in other orders, so they agree to float32 rounding (1e-5 of the output's scale).
- int8: x rounded to int8 per block of 32, exact integer block sums, one float32 scale per block.
  Kernel and fallback agree to float32 rounding; against float32 activations the int8 rounding of x
  costs about 0.5% of the output's norm (x is Gaussian here); 2% is the bound.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.model import quant
from tandem.model.block_formats import NATIVE_FORMATS, Q4_1
from tandem.model.quant import QuantizedWeight, reference_linear
from tandem.ops import extension

# The formats gguf-py can quantize (blocks of 32); the K-quants are tests/test_kquants.py's.
FORMATS = [f.name for f in NATIVE_FORMATS.values() if f.block_weights == 32]
ROWS = [1, 2, 3, 8, 32, 128, 512]
kernel = pytest.mark.skipif(not extension.extension_available(), reason="compiled ops unavailable")


def make_weight(fmt_name: str, out_features: int, in_features: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight quantized by gguf-py, and gguf-py's float32 dequantization of it."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt_name]
    rows = gguf.quants.quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05, qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(rows, qtype).astype(np.float32))
    return QuantizedWeight.from_numpy(rows, NATIVE_FORMATS[int(qtype)], in_features), dense


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


ARITHMETICS = {"float": False, "int8": True}  # name -> int8_activations


def op(int8: bool):  # noqa: ANN201 (a torch op)
    return torch.ops.tandem.gguf_linear_q8 if int8 else torch.ops.tandem.gguf_linear


def fallback(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """The pure-PyTorch arithmetic, whatever the extension."""
    dense = quant.torch_dequantize(w.data, w.fmt, w.in_features)
    xf = quant._torch_q8_roundtrip(x) if int8 else x.float()
    out = torch.nn.functional.linear(xf, dense, None if bias is None else bias.float())
    return out.to(x.dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding of sums in another order."""
    return (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf_py(fmt: str) -> None:
    w, dense = make_weight(fmt, 37, 96, seed=1)
    assert torch.equal(quant.torch_dequantize(w.data, w.fmt, w.in_features), dense)
    assert torch.equal(w.dequantize(), dense)  # the kernel where it is built


@kernel
@pytest.mark.parametrize("arith", ARITHMETICS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(37, 96), (160, 64), (5, 288)], ids=["odd-out", "even", "few-out"])
def test_kernel_matches_fallback_and_float_reference(arith: str, fmt: str, rows: int, shape: tuple[int, int]) -> None:
    int8 = ARITHMETICS[arith]
    out_features, in_features = shape
    w, dense = make_weight(fmt, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = op(int8)(x, w.data, w.fmt.ggml_type, in_features, None)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    want = fallback(x, w, int8=int8)
    assert close(got, want)
    if int8:
        assert rel_err(got, x @ dense.T) < 0.02
    else:
        assert close(got, x @ dense.T)  # gguf-py's dequantization: the same weights exactly
    # The many-rows path (one float32 GEMM on the same values) agrees as closely.
    assert close(reference_linear(x, w, int8_activations=int8), want)


@kernel
@pytest.mark.parametrize("arith", ARITHMETICS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_is_the_same_whatever_the_batch_and_threads(arith: str, fmt: str) -> None:
    """A row's output does not depend on which rows share its call (tiles of 8, 4, 2 or 1 rows meeting 1,
    2, 4 or 8 weight rows, and their tails) nor on the thread count: bit for bit."""
    linear = op(ARITHMETICS[arith])
    w, _ = make_weight(fmt, 51, 128, seed=3)  # an odd weight row left over after the pairs
    x = torch.randn(23, 128, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([linear(x[i:i + 1], w.data, w.fmt.ggml_type, 128, None) for i in range(23)])
    together = linear(x, w.data, w.fmt.ggml_type, 128, None)
    assert torch.equal(alone, together)
    for cuts in ((3, 10), (5, 11), (6, 20)):  # 3 = 2 + 1 rows, 7 = 4 + 2 + 1, 13 = 8 + 4 + 1, ...
        parts = [x[a:b] for a, b in zip((0, *cuts), (*cuts, 23), strict=True)]
        assert torch.equal(torch.cat([linear(p, w.data, w.fmt.ggml_type, 128, None) for p in parts]), together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = linear(x, w.data, w.fmt.ggml_type, 128, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)


@kernel
@pytest.mark.parametrize("arith", ARITHMETICS)
def test_bias_bfloat16_and_leading_dims(arith: str) -> None:
    int8 = ARITHMETICS[arith]
    w, dense = make_weight("Q4_1", 40, 64, seed=4)
    bias = torch.randn(40)
    x = torch.randn(2, 3, 64)
    got = op(int8)(x, w.data, w.fmt.ggml_type, 64, bias)
    assert got.shape == (2, 3, 40)
    assert close(got, fallback(x, w, bias, int8))
    xb = x.bfloat16()
    gotb = op(int8)(xb, w.data, w.fmt.ggml_type, 64, bias)
    assert gotb.dtype == torch.bfloat16
    torch.testing.assert_close(gotb, fallback(xb, w, bias, int8), atol=1e-2, rtol=1e-2)  # one bf16 rounding apart


@kernel
def test_roundtrip_kernel_equals_fallback() -> None:
    x = torch.randn(7, 96) * torch.logspace(-3, 2, 96)
    x[3, :32] = 0  # an all-zero block has scale 0
    assert torch.equal(torch.ops.tandem.q8_roundtrip(x), quant._torch_q8_roundtrip(x))


@kernel
@pytest.mark.parametrize("arith", ARITHMETICS)
def test_kernel_rejects_a_mismatched_weight(arith: str) -> None:
    linear = op(ARITHMETICS[arith])
    w, _ = make_weight("Q4_0", 8, 64, seed=5)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        linear(torch.randn(1, 64), w.data, Q4_1.ggml_type, 64, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        linear(torch.randn(1, 48), w.data[:, :27].contiguous(), w.fmt.ggml_type, 48, None)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        linear(torch.randn(1, 64), w.data, 10, 64, None)  # Q2_K
    with pytest.raises(RuntimeError, match="features, expected"):
        linear(torch.randn(1, 96), w.data, w.fmt.ggml_type, 64, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        linear(torch.randn(1, 64).double(), w.data, w.fmt.ggml_type, 64, None)


@kernel
def test_many_bf16_rows_run_one_bf16_gemm_on_the_dense_bf16_weights() -> None:
    w, dense = make_weight("Q4_1", 96, 64, seed=10)
    x = torch.randn(quant.gemm_rows() + 7, 64).bfloat16()
    got = quant.quantized_linear(x, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(x, dense.bfloat16()))  # what the dense bf16 model computes


@pytest.mark.parametrize("arith", ARITHMETICS)
def test_quantized_linear_without_the_extension_is_the_fallback(arith: str, monkeypatch: pytest.MonkeyPatch) -> None:
    int8 = ARITHMETICS[arith]
    w, dense = make_weight("Q8_0", 24, 64, seed=6)
    x = torch.randn(5, 64)
    monkeypatch.setattr(quant, "_kernel", lambda t: False)
    got = quant.quantized_linear(x, w, int8_activations=int8)
    assert torch.equal(got, fallback(x, w, int8=int8))
    assert rel_err(got, x @ dense.T) < (0.02 if int8 else 1e-6)


def test_fused_rows_concatenate() -> None:
    """A fused layer (qkv, gate_up) takes each part's blocks into its rows, in order; parts of another
    format or width are refused."""
    from tandem.model.linear import GGUFMethod, Linear

    a, da = make_weight("Q4_1", 8, 64, seed=7)
    b, db = make_weight("Q4_1", 4, 64, seed=8)
    method = GGUFMethod(a.fmt)
    layer = Linear(64, 12, False, torch.float32, method)
    method.load(layer, [a, b])
    assert torch.equal(layer.quantized_weight().dequantize(), torch.cat([da, db]))
    c, _ = make_weight("Q8_0", 4, 64, seed=9)
    with pytest.raises(ValueError, match="expects Q4_1"):
        method.load(layer, [a, c])
    d, _ = make_weight("Q4_1", 4, 128, seed=10)
    with pytest.raises(ValueError, match="widths"):
        method.load(layer, [a, d])
