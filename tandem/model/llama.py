"""The Llama family (Llama, SmolLM2, Mistral with its sliding window, Qwen2 with qkv bias, Qwen3
with q/k norm) and the families that differ from it only in settings (Phi-3, SmolLM3's layers without
RoPE, Granite's multipliers), and the attention block other families reuse (model/gemma3.py).

A pure function of the packed batch and the KV pool: token ids and attention metadata in,
logits for the sampled positions out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.model.arch import ArchConfig
from tandem.model.attention import AttentionMetadata, paged_attention, paged_attention_sampled
from tandem.model.causal_lm import CausalLM, Methods
from tandem.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from tandem.model.linear import DENSE, Linear
from tandem.ops import fused


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, prefix: str, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.window = cfg.window(layer)
        self.rotates = cfg.rotates(layer)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype,
                               methods.get(f"{prefix}qkv_proj", DENSE))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, methods.get(f"{prefix}o_proj", DENSE))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # gpt-oss: each head's sink logit, float32 as the kernels' softmax is
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False) if cfg.attn_sinks else None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D], normed where the family norms them, not yet rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sampled_only: bool = False) -> torch.Tensor:
        """sampled_only: every row's K/V is stored, the output has meta.sampled_rows only."""
        q, k, v = self.qkv(x)
        if self.rotates:
            q, k = fused.rotary(q, k, cos, sin)
        attend = paged_attention_sampled if sampled_only else paged_attention
        out = attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, layer: int) -> None:
        super().__init__()
        prefix = f"layers.{layer}."
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype, methods, f"{prefix}self_attn.", layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        mlp = f"{prefix}mlp."
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype,
                            methods.get(f"{mlp}gate_up_proj", DENSE), methods.get(f"{mlp}down_proj", DENSE))
        self.residual_scale = cfg.residual_scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sampled_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output, not yet added to the residual stream (None: first layer);
        the add is fused into this layer's first norm, as the next layer fuses ours. sampled_only:
        after storing every row's K/V, carry on with meta.sampled_rows alone (the last layer)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, sampled_only)
        if sampled_only:
            residual = residual[meta.sampled_rows]
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        out = self.mlp(h)
        return (out * self.residual_scale if self.residual_scale != 1.0 else out), residual


class LlamaForCausalLM(CausalLM):
    layer_cls: type[nn.Module] = LlamaDecoderLayer  # a family on this one swaps its layer (qwen3_moe.py, olmo2.py)

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods | None = None) -> None:
        super().__init__(cfg, dtype, methods, self.layer_cls)

    def init_buffers(self, device: torch.device | str) -> None:
        self.rotary = RotaryEmbedding.of(self.cfg, self.norm.weight.dtype).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: torch.Tensor,
                logits_indices: torch.Tensor, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """See CausalLM.forward. When meta.sampled_rows is set (the same rows as logits_indices, fewer
        than all), the last layer runs attention, o_proj and the MLP for those rows only: nothing reads
        the others' outputs."""
        cos, sin = self.rotary.lookup(meta.positions)
        x, residual = self.embed_tokens(input_ids), None
        if self.cfg.embed_scale != 1.0:  # Granite's embedding multiplier
            x = x * self.cfg.embed_scale
        skip = meta.sampled_rows is not None
        native = self.native_layers_forward(x, (cos, sin), None, kv_caches, meta, after_layer)
        if native is not None:
            x, residual = native
        else:
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, cos, sin, kv_cache, meta, skip and i == last)
                if after_layer is not None:
                    after_layer(i)
        if not skip:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.add_forward(x, residual)
        logits = self.lm_head(x)
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits
