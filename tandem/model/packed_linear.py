"""Linear layers whose weights are packed once, at load time, into oneDNN's blocked layout (CPU, bf16).

F.linear on CPU hands oneDNN a plain [out, in] weight, which it reorders into its blocked AMX
layout on every call; at the few rows of a decode step that reorder costs as much as the product.
Packing once (torch.ops.mkldnn._reorder_linear_weight, as inductor's weight-freezing pass does)
made decode-sized matmuls 20-40% faster on the development machine (the lm_head at 64 rows: 10 ms
to 5.5 ms) and left prompt-sized ones (1024+ rows) within noise. The packed tensor replaces the
plain weight, so memory does not grow (a tied lm_head keeps the embedding and adds its packed copy).

Up to 32 rows (decode at low concurrency) a linear layer is a weight stream, which oneDNN read at
~9-14 GB/s here; the compiled small_batch_linear (tandem/ops/linear.cpp) reads it at 11-24 GB/s.
Such layers hold the weight in that op's panel layout. On AMX, oneDNN's tile GEMMs are faster past
32 rows, so there a layer keeps oneDNN's copy too (twice the linear weights' bytes, reported at
start-up); without AMX the panels stay within 0.93-1.03x of oneDNN from 32 to 2,048 rows and serve
every row, so the layer holds one copy (benchmarks/small_batch_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.ops import extension

# The row count oneDNN picks its packed format for; decode batches are around this size.
BATCH_HINT = 256


def _has_amx() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


# Up to this many rows small_batch_linear serves, past them oneDNN's copy (benchmarks/small_batch_linear.py).
# On AMX (Sapphire Rapids): 1.2-1.5x at 1-32 rows, 0.73x at 48, where a brgemm call past 32 rows falls
# off a cliff. With dpbf16 only (Zen 4): 1.6-1.9x at 1-8 rows, 1.1-1.2x at 16-48, 0.97-1.03x at 128-1,024,
# 0.93x at 2,048: every row (None), and no oneDNN copy.
SMALL_BATCH_ROWS: int | None = 32 if _has_amx() else None


def small_batch_supported() -> bool:
    return extension.extension_available() and extension.extension_isa() == "avx512-bf16"


def _fake_small_batch(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


extension.register_fake("small_batch_linear", _fake_small_batch)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and native_bf16())


def native_bf16() -> bool:
    """oneDNN runs bf16 natively here (AVX512-BF16, AMX, or AVX-NE-CONVERT); on plain AVX2 it cannot
    pack bf16 weights at all, and bf16 matmuls fall back to slow converting loops."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A bf16 weight [out, in] packed for oneDNN (and for small_batch_linear where it runs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        panels = None
        if small_batch_supported() and self.in_features % 2 == 0:
            panels = torch.ops.tandem.pack_linear_weight(weight.detach())
        self.register_buffer("panels", panels, persistent=False)
        packed = None
        if panels is None or SMALL_BATCH_ROWS is not None:  # rows the panels do not serve
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        limit = SMALL_BATCH_ROWS
        # Batch-invariant kernels (the default): the panels at any row count, one order of sums a row.
        if self.panels is not None and (self.packed_weight is None or limit is None or rows.shape[0] <= limit
                                        or extension.batch_invariant()):
            out = torch.ops.tandem.small_batch_linear(rows, self.panels, self.bias, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

