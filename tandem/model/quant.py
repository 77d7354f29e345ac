"""GGUF block-quantized weights held as stored (model/block_formats.py: Q4_0, Q4_1, Q5_0, Q8_0 and the
K-quants Q4_K, Q5_K, Q6_K), and the products that read them.

A QuantizedWeight is a checkpoint tensor's rows of ggml blocks (32 or 256 weights along K each), untouched.
Rows are independent, so the loader fuses q/k/v (and gate/up) and undoes llama.cpp's rotary row
permutation on the blocks themselves.

Two arithmetics multiply by them:

  float (default)  x stays in float; each block is dequantized in registers and meets x in float32
                   FMAs (tandem/ops/quant_linear.cpp): F.linear(x, dequantized W) up to summation
                   order, so the dequantized model is its reference.
  int8             llama.cpp's: x is quantized to int8 per block of 32, or of 256 against the K-quants
                   (q8_roundtrip gives the values that stand for it), and each block's dot product is
                   exact in integers, scaled once (tandem/ops/quant_linear_q8.cpp, quant_linear_k8.cpp).
                   The kernel serves every row count, so a row's value is the same in any batch or
                   chunk. Rounding x is discontinuous: a one-ulp difference upstream (a kernel that is
                   not batch-invariant) can flip a value and, in time, a greedy token, so it is opt-in.

Either kernel is one stream over the weight bytes for a few rows. For many rows with float
activations, where the matmul's FLOPs and not its bytes set the time, the same values go through one
GEMM on weights dequantized for that call (a layer's worth, in a reused scratch buffer): float32, or
bfloat16 for bfloat16 x. The PyTorch fallbacks here (any device) compute the same.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.model.block_formats import BlockFormat, torch_dequantize
from tandem.ops import extension

X_BLOCK = 32  # the int8 activations' block


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight as rows of ggml blocks: data is uint8 [out, blocks * block_bytes];
    or a stack of experts' weights, [experts, out, row bytes] (model/qwen3_moe.py splits it by expert)."""

    data: torch.Tensor
    fmt: BlockFormat
    in_features: int

    @classmethod
    def from_numpy(cls, rows: np.ndarray, fmt: BlockFormat, in_features: int) -> QuantizedWeight:
        return cls(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8)), fmt, in_features)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] (a stack: [experts, out, in])."""
        rows = dequantize(self.data.reshape(-1, self.data.shape[-1]), self.fmt, self.in_features)
        return rows.view(*self.data.shape[:-1], self.in_features)

    def unstack(self) -> list[QuantizedWeight]:
        """A stack's weights, one an expert (views)."""
        return [QuantizedWeight(part, self.fmt, self.in_features) for part in self.data]


def slice_weight(w: QuantizedWeight, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> QuantizedWeight:
    """A [rows, cols] part of a weight, still in its blocks (a tensor-parallel shard). Columns must
    start and end on block boundaries: ValueError otherwise (the caller dequantizes instead)."""
    data = w.data if rows is None else w.data[rows[0]:rows[1]]
    if cols is None:
        return QuantizedWeight(data, w.fmt, w.in_features)
    step = w.fmt.block_weights
    if cols[0] % step or cols[1] % step:
        raise ValueError(f"{w.fmt.name} columns split only at multiples of {step}, not {cols}")
    per = w.fmt.block_bytes
    return QuantizedWeight(data[:, cols[0] // step * per:cols[1] // step * per].contiguous(), w.fmt, cols[1] - cols[0])


# -- PyTorch fallbacks (any device) -----------------------------------------------------------------

def _torch_q8_roundtrip(x: torch.Tensor, block: int = X_BLOCK) -> torch.Tensor:
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (scale * torch.round(blocks * inv)).reshape(x.shape)


def _kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and extension.extension_available()


def dequantize(data: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    """float32 [out_features, in_features]."""
    if _kernel(data):
        return torch.ops.tandem.gguf_dequantize(data, fmt.ggml_type, in_features)
    return torch_dequantize(data, fmt, in_features)


def q8_roundtrip(x: torch.Tensor, block: int = X_BLOCK) -> torch.Tensor:
    """x as its per-block int8 quantization stands for it, in float32 (blocks of 32, or of 256 for the
    K-quants: x_block)."""
    if _kernel(x) and x.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.tandem.q8_roundtrip(x, block)
    return _torch_q8_roundtrip(x, block)


def x_block(fmt: BlockFormat) -> int:
    """The block the int8 activations are quantized in against this format: its own (a K-quant's
    super-block of 256, llama.cpp's Q8_K; 32 for the others)."""
    return fmt.block_weights


@functools.cache
def gemm_rows() -> int:
    """Past this many rows the kernels lose to dequantizing the layer and one float32 GEMM
    (benchmarks/quantization.py --parts kernels). With AVX512 (16-wide FMAs) the float kernel matched or
    beat dequantize + GEMM up to 128 rows on the default model's shapes (960 x 576 at 128 rows: 1.48
    against 1.82 ms) and lost from ~256 (13.1 against 8.8 ms at 512 for 1728 x 576); on AVX2 the
    int8 kernel lost past 32. TANDEM_QUANT_GEMM_ROWS overrides it."""
    if "TANDEM_QUANT_GEMM_ROWS" in os.environ:
        return int(os.environ["TANDEM_QUANT_GEMM_ROWS"])
    return 128 if (extension.extension_isa() or "").startswith("avx512") else 32


# A matrix this large (the default model's 49152 x 576 lm_head) is never dequantized per call: the
# fresh float32 copy (113 MB) costs more in page faults and memory traffic than the kernel's sums.
MAX_DEQUANTIZED_WEIGHTS = 8 << 20
UNLIMITED_ROWS = 1 << 62  # a native linear form that serves any number of rows


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                     int8_activations: bool = False) -> torch.Tensor:
    """x [..., in_features] (float32 or bfloat16) times w^T, in x's dtype."""
    if _kernel(x) and x.dtype in (torch.float32, torch.bfloat16):
        rows = x.numel() // w.in_features
        # int8 activations: the kernel at every row count, so a row's value never depends on the batch or
        # the chunk it is in (the int8 sums make a row's cost near a float GEMM's anyway: a 1B model's
        # 256-token prompt took 2.5-2.8 s either way on a 2-core Zen 4).
        if rows <= gemm_rows() or int8_activations or w.out_features * w.in_features > MAX_DEQUANTIZED_WEIGHTS:
            op = torch.ops.tandem.gguf_linear_q8 if int8_activations else torch.ops.tandem.gguf_linear
            return op(x, w.data, w.fmt.ggml_type, w.in_features, bias)
        if x.dtype == torch.bfloat16 and not int8_activations:
            return bf16_gemm_linear(x, w, bias)
    return reference_linear(x, w, bias, int8_activations)


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch_matrix(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    n = w.out_features * w.in_features
    key = (w.data.device, dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < n:
        buf = _scratch[key] = torch.empty(n, dtype=dtype, device=w.data.device)
    return buf[:n].view(w.out_features, w.in_features)


def _dequantized(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w in dtype, in this device's scratch buffer where the kernel runs (valid until the next call)."""
    if not _kernel(w.data):
        return w.dequantize().to(dtype)
    out = _scratch_matrix(w, torch.float32)
    torch.ops.tandem.gguf_dequantize_into(out, w.data, w.fmt.ggml_type, w.in_features)
    return out if dtype == torch.float32 else _scratch_matrix(w, dtype).copy_(out)


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                     int8_activations: bool = False) -> torch.Tensor:
    """The same arithmetic as one float32 GEMM: the fallback, and the many-rows path for float32 x."""
    xf = q8_roundtrip(x, x_block(w.fmt)) if int8_activations else x.float()
    out = F.linear(xf, _dequantized(w), None if bias is None else bias.float())
    return out.to(x.dtype)


def bf16_gemm_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 x on many rows: one bfloat16 GEMM (oneDNN, several times the float32 rate where the
    CPU computes bf16 natively) on w dequantized and rounded to bfloat16, the very values the dense
    bf16 model holds."""
    return F.linear(x, _dequantized(w, torch.bfloat16), bias)


def _fake_linear(x: torch.Tensor, w: torch.Tensor, qtype: int, in_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


extension.register_fake("gguf_linear", _fake_linear)
extension.register_fake("gguf_linear_q8", _fake_linear)
