"""Fused elementwise ops of the model's hot path: compiled (``fused.cpp``) with PyTorch fallbacks.

Each ``*_torch`` fallback is the reference: the plain PyTorch ops, in the order and with the
rounding of the Hugging Face implementation. The kernels repeat those rounding steps, so both
paths agree to the bit (to rounding where a sum's order or an exp differs: rms_norm, silu).
The dispatching functions use a kernel when the extension is loaded and the tensors suit it
(CPU, float32 or bfloat16, no autograd), and the fallback otherwise, so any device works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.ops import extension

_DTYPES = (torch.float32, torch.bfloat16)


def _suits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == tensors[0].dtype and t.dtype in _DTYPES
               and not (torch.is_grad_enabled() and t.requires_grad) for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    if _suits(x, weight) and weight.is_contiguous() and (op := extension.op("rms_norm")) is not None:
        return op(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and round once, as the reference implementation does.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a decoder layer's residual add and the next norm."""
    if (x.dim() == 2 and _suits(x, residual, weight) and x.stride(-1) == 1 and residual.stride(-1) == 1
            and weight.is_contiguous() and (op := extension.op("add_rms_norm")) is not None):
        out, res = op(x, residual, weight, eps)
        return out, res
    return add_rms_norm_torch(x, residual, weight, eps)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, KVH, D] with cos/sin [T, R] of their positions: the
    first R <= D dimensions of each head rotate (R < D: partial rotary), the rest pass through.

    The kernel rotates q and k in place (they may be strided views of one qkv projection); the
    fallback returns new tensors. Use the returned pair either way."""
    if (_suits(q, k, cos, sin) and q.stride(-1) == 1 and k.stride(-1) == 1 and q.stride(1) == q.shape[2]
            and k.stride(1) == k.shape[2] and cos.is_contiguous() and sin.is_contiguous()
            and (op := extension.op("rotary_")) is not None):
        op(q, k, cos, sin)
        return q, k
    return rotary_torch(q, k, cos, sin)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    r = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    if x.dim() == 2 and x.stride(-1) == 1 and _suits(x) and (op := extension.op("silu_and_mul")) is not None:
        return op(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise index of the maximum of x [N, V] (the first one on ties), as int64 [N].

    The kernel reads bf16 logits directly: greedy sampling needs no float32 copy of them."""
    if x.dim() == 2 and x.shape[1] and x.stride(-1) == 1 and _suits(x) and (op := extension.op("argmax")) is not None:
        return op(x)
    return x.argmax(-1)
