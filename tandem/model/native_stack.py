"""The decoder layers of the Llama family and Gemma 3 as one native call per step (tandem/ops/layer_stack.cpp).

The stack holds the same weight tensors the modules hold (no copy) and calls the same kernels the
Python layer loop calls, in the same order, so both give the same bits; the Python loop stays the
reference and serves every step the stack cannot: kernels unavailable or disabled, another
device, a layer-wise KV connector (it runs between layers), more rows than a linear's native form
serves, or prompt rows the prefill kernel cannot read (a portable build, an int8 pool).

TANDEM_NATIVE_LAYERS=0 turns the stack off (the Python loop serves every step).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandem.model.attention import AttentionMetadata
from tandem.model.linear import Linear
from tandem.ops import extension
from tandem.ops.paged_attention import prefill_kernel_supports

_DTYPES = (torch.float32, torch.bfloat16)


def native_layers_enabled() -> bool:
    return os.environ.get("TANDEM_NATIVE_LAYERS", "1").strip().lower() not in ("0", "false", "no", "off")


_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def build_layer_stack(model: Any) -> Any | None:
    """A LayerStack for the layers of a LlamaForCausalLM (and the families on it: partial rotary, layers
    without RoPE, Granite's residual multiplier, OLMo 2's norms after attention and the MLP) or a
    Gemma3ForCausalLM, or None where it cannot serve them."""
    if not native_layers_enabled() or not extension.extension_available():
        return None
    norm = model.norm.weight
    cfg = model.cfg
    if cfg.num_experts or cfg.attn_sinks:  # the stack has no mixture of experts, and no attention sinks
        return None
    if norm.device.type != "cpu" or norm.dtype not in _DTYPES or cfg.head_dim % 16:  # the kernels' rows
        return None
    first = model.layers[0].self_attn
    act = _ACTIVATIONS.get(model.layers[0].mlp.act)
    if act is None or any(layer.mlp.act != model.layers[0].mlp.act for layer in model.layers):
        return None
    stack = torch.classes.tandem.LayerStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                            first.scale, act)
    if cfg.residual_scale != 1.0:
        stack.set_residual_scale(cfg.residual_scale)
    none = torch.empty(0, dtype=norm.dtype)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = attn.q_norm.weight if attn.q_norm is not None else none
        k_norm = attn.k_norm.weight if attn.k_norm is not None else none
        post_norms = not hasattr(layer, "input_layernorm")  # OLMo 2: norms after attention and the MLP only
        stack.add_layer(none if post_norms else layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        q_norm, k_norm, attn.window, attn.rotates)
        if post_norms:
            stack.set_post_norms(layer.post_feedforward_layernorm.weight)
        elif hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3
            stack.set_sandwich(layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight,
                               layer.local)
        linear: Linear
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            form = linear.method.native_form(linear)
            if form is None:
                return None
            bias = linear.bias if linear.bias is not None else none
            if form.parts:  # gguf-split: parts in different block formats, side by side
                stack.add_split_linear([p.kind for p in form.parts], [p.weight for p in form.parts],
                                       [p.out_features for p in form.parts], [p.qtype for p in form.parts],
                                       [p.max_rows for p in form.parts], bias, linear.in_features)
                continue
            stack.add_linear(form.kind, form.weight, bias, linear.out_features, linear.in_features, form.qtype,
                             form.max_rows, form.wide)
    return stack


def stack_serves(stack: Any, x: torch.Tensor, kv_caches: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the stack can run this step (x: its embedded rows)."""
    if x.shape[0] > stack.max_rows() or kv_caches.device.type != "cpu":
        return False
    if stack.group_slot_bytes() and x.shape[0] * x.shape[1] * x.element_size() > stack.group_slot_bytes():
        return False  # a worker group's all-reduce too wide for its exchange: the Python loop's gloo path
    if kv_caches.dtype not in (x.dtype, torch.int8):
        return False
    if meta.num_prefills:
        cache = kv_caches[0, 0]
        return prefill_kernel_supports(x.new_empty(0, 1, cache.shape[-1]), cache, cache)
    return True


def run_layer_stack(stack: Any, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    local_rope: tuple[torch.Tensor, torch.Tensor] | None, kv_caches: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's output and residual (not yet added), as the Python loop leaves them.
    rope: (cos, sin) rows of the step's positions; local_rope: the sliding layers' (Gemma 3)."""
    sampled = meta.sampled_rows is not None
    empty_long, empty_int = x.new_empty(0, dtype=torch.long), x.new_empty(0, 0, dtype=torch.int32)
    local_cos, local_sin = local_rope if local_rope is not None else (x.new_empty(0), x.new_empty(0))
    return stack.forward(x, *rope, local_cos, local_sin, kv_caches, meta.slot_mapping, meta.num_decode_tokens,
                         meta.decode_block_tables,
                         meta.decode_seq_lens, meta.prefill_block_tables, meta.prefill_query_start,
                         meta.prefill_seq_lens, sampled,
                         meta.sampled_rows if sampled else empty_long,
                         meta.sampled_block_tables if sampled else empty_int,
                         meta.sampled_seq_lens if sampled else empty_int.view(0))
