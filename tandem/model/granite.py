"""Granite 3.x (transformers' GraniteForCausalLM, llama.cpp's granite): the Llama family's layers with
four multipliers: embeddings, attention scores (in place of head_dim ** -0.5), each attention and MLP
output before the residual add, and the logits (divided)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.model import arch as llama_arch
from tandem.model.arch import ArchConfig

HF_ARCHITECTURES = ("GraniteForCausalLM",)
GGUF_ARCHITECTURE = "granite"


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    base = llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context)
    if cfg.get("mlp_bias"):
        raise NotImplementedError("Granite with mlp_bias is not supported yet")
    return replace(base, embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                   attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                   residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                   logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """llama.cpp's granite keys: embedding_scale, attention.scale, residual_scale and logit_scale (the
    converter writes only the ones a config sets; absent, llama.cpp takes 1, and head_dim ** -0.5 for
    the scores)."""
    base = llama_arch.llama_shape_from_gguf(meta, GGUF_ARCHITECTURE, has_output_weight, has_qkv_bias)

    def key(name: str) -> float:
        return float(meta.get(f"{GGUF_ARCHITECTURE}.{name}") or 1.0)

    scale = meta.get(f"{GGUF_ARCHITECTURE}.attention.scale")
    return replace(base, embed_scale=key("embedding_scale"), attn_scale=float(scale) if scale else None,
                   residual_scale=key("residual_scale"), logits_scaling=key("logit_scale"))
