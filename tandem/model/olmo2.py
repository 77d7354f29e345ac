"""OLMo 2 (transformers' Olmo2ForCausalLM, llama.cpp's olmo2): norms after attention and after the
MLP instead of before them, and q/k norms over the whole projection (not per head). The native
stack (ops/layer_stack.cpp, set_post_norms) runs the same ops in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.model import arch as llama_arch
from tandem.model.arch import ArchConfig
from tandem.model.attention import AttentionMetadata
from tandem.model.causal_lm import Methods
from tandem.model.layers import GatedMLP, RMSNorm
from tandem.model.linear import DENSE
from tandem.model.llama import LlamaAttention, LlamaForCausalLM

HF_ARCHITECTURES = ("Olmo2ForCausalLM",)
GGUF_ARCHITECTURE = "olmo2"
GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, prefix: str, layer: int) -> None:
        super().__init__(cfg, dtype, methods, prefix, layer)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, dtype)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, layer: int) -> None:
        super().__init__()
        prefix, hidden, eps = f"layers.{layer}.", cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Olmo2Attention(cfg, dtype, methods, f"{prefix}self_attn.", layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        mlp = f"{prefix}mlp."
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, dtype, methods.get(f"{mlp}gate_up_proj", DENSE),
                            methods.get(f"{mlp}down_proj", DENSE))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sampled_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is not yet in the residual stream (the next layer, or the
        final norm, adds it)."""
        if residual is not None:
            x = x + residual
        h = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, meta, sampled_only))
        if sampled_only:
            x = x[meta.sampled_rows]
        residual = x + h
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    return llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context)


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    if meta.get(f"{GGUF_ARCHITECTURE}.attention.sliding_window"):
        raise NotImplementedError("OLMo 3's sliding-window layers are not supported yet")
    return llama_arch.llama_shape_from_gguf(meta, GGUF_ARCHITECTURE, has_output_weight, has_qkv_bias)
