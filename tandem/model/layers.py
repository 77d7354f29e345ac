"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

The arithmetic lives in tandem.ops.fused (compiled kernels with PyTorch fallbacks); these modules
hold the weights and tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.arch import ArchConfig
from tandem.model.linear import DENSE, Linear, LinearMethod
from tandem.model.rope import inv_freq
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
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position, over the first
    rotary_dim dimensions of each head (all of them unless the rotary is partial)."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, dtype: torch.dtype,
                 linear_factor: float = 1.0, freq_factors: tuple[float, ...] = (),
                 attention_factor: float = 1.0) -> None:
        """linear_factor: linear RoPE scaling (positions divided by it, as HF's rope_type "linear");
        freq_factors: each pair's divisor (Llama 3's and YaRN's scaling, model/rope.py); attention_factor:
        cos and sin scaled by it (YaRN's)."""
        super().__init__()
        # On the CPU even while a model is built on the meta device: a meta-device division imports
        # torch._dynamo (2-3 s of every start-up); the table is a few MiB, moved by init_buffers.
        cpu = torch.device("cpu")
        freq = inv_freq(rotary_dim, theta) / linear_factor
        if freq_factors:
            freq = freq / torch.tensor(freq_factors, dtype=torch.float32, device=cpu)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=cpu), freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_factor).to(dtype), persistent=False)

    @classmethod
    def of(cls, cfg: ArchConfig, dtype: torch.dtype, local: bool = False) -> RotaryEmbedding:
        """The model's table; local: the sliding-window layers' own (Gemma 3: another base, unscaled)."""
        if local:
            return cls(cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_local_theta, dtype)
        return cls(cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_theta, dtype, cfg.rope_scaling_factor,
                   cfg.rope_freq_factors, cfg.rope_attention_factor)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, D] for a step's positions (looked up once per step, used by every layer)."""
        return self.cos[positions], self.sin[positions]


class GatedMLP(nn.Module):
    """act(gate) * up with gate and up projections fused into one matmul: SwiGLU (silu), or GeGLU with
    the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, gate_up: LinearMethod = DENSE,
                 down: LinearMethod = DENSE, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.intermediate, self.act = intermediate, act
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, gate_up)
        self.down_proj = Linear(intermediate, hidden, False, dtype, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(fused.silu_and_mul(h))
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
