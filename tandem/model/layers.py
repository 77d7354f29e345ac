"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

The arithmetic lives in tandem.ops.fused (compiled kernels with PyTorch fallbacks); these modules
hold the weights and tables.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.model.linear import DENSE, Linear, LinearMethod
from tandem.ops import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused with this norm."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, D] for a step's positions (looked up once per step, used by every layer)."""
        return self.cos[positions], self.sin[positions]


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, gate_up: LinearMethod = DENSE,
                 down: LinearMethod = DENSE) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, gate_up)
        self.down_proj = Linear(intermediate, hidden, False, dtype, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
