"""Gemma 3 (text): sliding-window layers with their own RoPE base between global ones (five to one),
q/k norms, a norm after attention and around the MLP, GeGLU, embeddings scaled by sqrt(hidden), and
optional soft-capping of the logits.

Norm weights are held as the multiplier (1 + w): GGUF files store them so, and a Hugging Face
checkpoint's w gets its 1 added at load (registry.py), so the shared RMSNorm serves unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.model.arch import ArchConfig, gguf_end_tokens, layer_windows, token_ids
from tandem.model.attention import AttentionMetadata
from tandem.model.causal_lm import CausalLM, Methods
from tandem.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from tandem.model.linear import DENSE
from tandem.model.llama import LlamaAttention

# Gemma 3's layer pattern when a file does not spell it out (GGUF): every sixth layer is global.
SLIDING_WINDOW_PATTERN = 6


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, layer: int) -> None:
        super().__init__()
        prefix, hidden, eps = f"layers.{layer}.", cfg.hidden_size, cfg.rms_norm_eps
        self.local = cfg.window(layer) > 0  # sliding-window layers use the local rotary table
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype, methods, f"{prefix}self_attn.", layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        mlp = f"{prefix}mlp."
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, dtype, methods.get(f"{mlp}gate_up_proj", DENSE),
                            methods.get(f"{mlp}down_proj", DENSE), act=cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict[bool, tuple[torch.Tensor, ...]],
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sampled_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is not yet in the residual stream; the add is fused into the
        next norm. rope: {local?: (cos, sin)}."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        cos, sin = rope[self.local]
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta, sampled_only))
        if sampled_only:
            residual = residual[meta.sampled_rows]
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods | None = None) -> None:
        super().__init__(cfg, dtype, methods, Gemma3DecoderLayer)
        self.rotary_local = RotaryEmbedding.of(cfg, dtype, local=True)

    def init_buffers(self, device: torch.device | str) -> None:
        dtype = self.norm.weight.dtype
        self.rotary = RotaryEmbedding.of(self.cfg, dtype).to(device)
        self.rotary_local = RotaryEmbedding.of(self.cfg, dtype, local=True).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: torch.Tensor,
                logits_indices: torch.Tensor, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """See CausalLM.forward; the last layer computes the sampled rows only, as in LlamaForCausalLM."""
        rope = {False: self.rotary.lookup(meta.positions), True: self.rotary_local.lookup(meta.positions)}
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale rounded to the activations' dtype; so does this.
        x, residual = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype), None
        last = len(self.layers) - 1
        skip = meta.sampled_rows is not None
        native = self.native_layers_forward(x, rope[False], rope[True], kv_caches, meta, after_layer)
        if native is not None:
            x, residual = native
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, rope, kv_cache, meta, skip and i == last)
                if after_layer is not None:
                    after_layer(i)
        if not skip:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.add_forward(x, residual)
        logits = self.lm_head(x)
        if self.cfg.final_softcap > 0:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


# -- configuration ------------------------------------------------------------------------------

def _rope(params: dict[str, Any], theta: float) -> tuple[float, float]:
    """(base, linear factor) of one rotary table; only default and linear RoPE are implemented."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")
    return float(params.get("rope_theta", theta)), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    """A Gemma3ForCausalLM config.json, as transformers 4 (rope_theta, rope_local_base_freq,
    rope_scaling) or 5 (rope_parameters per layer type) writes it. context: unused (Gemma 3's
    scalings do not depend on the deployment's length)."""
    heads, layers, hidden = cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg["hidden_size"]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, factor = _rope(params["full_attention"], 1_000_000.0)
        local, _ = _rope(params.get("sliding_attention", {}), 10_000.0)
    else:
        theta, factor = _rope(cfg.get("rope_scaling") or {}, float(cfg.get("rope_theta", 1_000_000.0)))
        local = float(cfg.get("rope_local_base_freq", 10_000.0))
    head_dim = cfg.get("head_dim") or 256
    eos = cfg.get("eos_token_id")
    return ArchConfig(
        architecture="gemma3", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True), qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=token_ids(eos),
        layer_windows=layer_windows(cfg.get("layer_types"), layers, int(cfg.get("sliding_window") or 4096),
                                     int(cfg.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)),
        rope_local_theta=local, rope_scaling_factor=factor,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        # attn_logit_softcapping is not read: Gemma 3 dropped it (its checkpoints say null) and
        # transformers' Gemma 3 never applies it; the kernels' softcap is there for Gemma 2.
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh", embed_scale=math.sqrt(hidden),
    )


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """llama.cpp's gemma3 keys; what they leave out is what llama.cpp assumes: the 5:1 layer
    pattern, a local RoPE base of 10000, scores scaled by head_dim ** -0.5 (27B: (hidden / heads) ** -0.5)."""
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"gemma3.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks gemma3.{key}")
        return value

    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", 256))
    scalar = hidden // heads if layers == 62 else head_dim  # llama.cpp's rule: only the 27B differs
    scaling = meta.get("gemma3.rope.scaling.type")
    factor = float(meta.get("gemma3.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if scaling not in (None, "none", "linear"):
        raise NotImplementedError(f"rope scaling {scaling!r} is not supported yet")
    return ArchConfig(
        architecture="gemma3", vocab_size=int(meta.get("gemma3.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden, intermediate_size=int(get("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(get("rope.freq_base")),
        max_position_embeddings=int(get("context_length", 131072)), tie_word_embeddings=not has_output_weight,
        qkv_bias=has_qkv_bias, qk_norm=True, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_tokens(meta),
        layer_windows=layer_windows(None, layers, int(get("attention.sliding_window")), SLIDING_WINDOW_PATTERN),
        rope_local_theta=10_000.0, rope_scaling_factor=factor, attn_scale=scalar ** -0.5,
        final_softcap=float(meta.get("gemma3.final_logit_softcapping") or 0.0),
        hidden_act="gelu_pytorch_tanh", embed_scale=math.sqrt(hidden),
    )
