"""gpt-oss (transformers' GptOssForCausalLM, llama.cpp's gpt-oss): the Llama family's attention with
biases, a learned sink logit per head (model/attention.py's sinks), sliding-window layers (128 keys)
alternating with global ones, YaRN without truncation, and in every layer a mixture of experts
(model/moe.py) whose router and experts have biases and whose activation is a clamped SwiGLU. The
model is Qwen3-MoE's (model/qwen3_moe.py, every layer sparse), which reads all of this from its
ArchConfig.

Checkpoints store the experts stacked: HF as gate_up_proj [experts, hidden, 2 * intermediate] with
gate and up interleaved column by column (transposed against a Linear's weight) and down_proj
[experts, intermediate, hidden]; llama.cpp's converter splits gate from up ([experts, out, in]
each). Both become per-expert tensors in HF's names, then the model's slots (model/qwen3_moe.py).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from tandem.model import arch as llama_arch
from tandem.model import qwen3_moe
from tandem.model.arch import ArchConfig, layer_windows, token_ids
from tandem.model.block_formats import MXFP4
from tandem.model.linear import Weight, dense
from tandem.model.quant import QuantizedWeight
from tandem.model.rope import rope_from_gguf

HF_ARCHITECTURES = ("GptOssForCausalLM",)
GGUF_ARCHITECTURE = "gpt-oss"
GGUF_LAYER_NAMES = {**qwen3_moe.GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                    "attn_sinks": "self_attn.sinks"}
SLIDING_WINDOW_PATTERN = 2  # every other layer slides, the first included (transformers' default, llama.cpp's rule)
# The clamped SwiGLU's constants, which llama.cpp's converter does not write (llama.cpp fixes them too).
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702
# Harmony's ends of a reply: after the final answer, and after a tool call. A GGUF file may declare
# only its eos; llama.cpp, too, ends generation on these by their text.
END_TOKENS = ("<|return|>", "<|call|>")


def _moe(base: ArchConfig, experts: int, used: int, intermediate: int, window: int, layer_types: list[str] | None,
         limit: float, alpha: float) -> ArchConfig:
    layers = base.num_layers
    return replace(base, num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=intermediate,
                   norm_topk_prob=True,  # a softmax over the top-k logits: the top-k probabilities renormalised
                   sparse_layers=tuple(range(layers)), moe_bias=True, swiglu_limit=limit, swiglu_alpha=alpha,
                   attn_sinks=True, qkv_bias=True, o_bias=True,
                   layer_windows=layer_windows(layer_types, layers, window, SLIDING_WINDOW_PATTERN) if window else ())


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    base = llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context)
    return _moe(base, int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                int(cfg.get("sliding_window") or 0), cfg.get("layer_types"),
                float(cfg.get("swiglu_limit", SWIGLU_LIMIT)), float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)))


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    prefix = f"{GGUF_ARCHITECTURE}."
    base = llama_arch.llama_shape_from_gguf(meta, GGUF_ARCHITECTURE, has_output_weight, has_qkv_bias)
    rope = rope_from_gguf(meta, GGUF_ARCHITECTURE, base.head_dim, base.max_position_embeddings, yarn_truncate=False)
    base = replace(base, rope_theta=rope.theta, rope_scaling_factor=rope.linear_factor,
                   rope_freq_factors=rope.freq_factors, rope_attention_factor=rope.attention_factor)
    window = int(meta.get(f"{prefix}attention.sliding_window") or 0)
    ends = [i for i, t in enumerate(meta.get("tokenizer.ggml.tokens") or []) if t in END_TOKENS]
    base = replace(base, eos_token_ids=token_ids(base.eos_token_ids, ends))
    return _moe(base, int(meta[f"{prefix}expert_count"]), int(meta[f"{prefix}expert_used_count"]),
                int(meta[f"{prefix}expert_feed_forward_length"]), window, None, SWIGLU_LIMIT, SWIGLU_ALPHA)


_HF_EXPERTS = re.compile(r"^((?:model\.)?layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")
_HF_MXFP4 = re.compile(r"^((?:model\.)?layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)_(blocks|scales)$")


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """A HF MXFP4 stack (blocks uint8 [experts, out, in / 32, 16], byte j holding weight 2j in its low
    nibble and 2j + 1 in its high one; scales uint8 [experts, out, in / 32], E8M0) as ggml's MXFP4 rows:
    per block the exponent, then 16 bytes whose low nibbles are weights 0-15 and high ones 16-31 (the
    layout llama.cpp's converter writes)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in K order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    data = torch.cat([scales.unsqueeze(-1), qs], dim=-1)  # [experts, out, in / 32, 17]
    return QuantizedWeight(data.reshape(*data.shape[:2], -1).contiguous(), MXFP4, blocks.shape[-2] * 32)


def prepare_weights(weights: dict[str, Weight], arch: ArchConfig) -> dict[str, Weight]:
    """The checkpoint's tensors in the names and layout the model loads (per expert, as
    qwen3_moe.per_expert leaves them): HF's interleaved, transposed expert stacks split into gate,
    up and down (its MXFP4 stacks into ggml's MXFP4 rows, held as stored); the router named as
    Qwen3-MoE's; GGUF's sinks without their `.weight`."""
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        packed = _HF_MXFP4.match(name)
        if packed is not None:
            if packed.group(3) == "scales":
                continue  # read with its blocks
            pre, kind = packed.group(1), packed.group(2)
            stack = mxfp4_from_hf(w, weights[name.removesuffix("_blocks") + "_scales"])  # type: ignore[arg-type]
            if kind == "gate_up_proj":  # rows (outputs) alternate gate, up
                out[f"{pre}gate_proj.weight"] = QuantizedWeight(stack.data[:, 0::2], MXFP4, stack.in_features)
                out[f"{pre}up_proj.weight"] = QuantizedWeight(stack.data[:, 1::2], MXFP4, stack.in_features)
            else:
                out[f"{pre}down_proj.weight"] = stack
            continue
        m = _HF_EXPERTS.match(name)
        if m is None:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            out[name.removesuffix(".weight") if name.endswith("self_attn.sinks.weight") else name] = w
            continue
        pre, kind, bias = m.group(1), m.group(2), m.group(3) is not None
        t = dense(w)
        if not bias:
            t = t.transpose(-1, -2)  # [experts, out, in], as a Linear holds it
        suffix = "bias" if bias else "weight"
        if kind == "gate_up_proj":  # columns (outputs) alternate gate, up
            out[f"{pre}gate_proj.{suffix}"] = t[:, 0::2].contiguous()
            out[f"{pre}up_proj.{suffix}"] = t[:, 1::2].contiguous()
        else:
            out[f"{pre}down_proj.{suffix}"] = t.contiguous()
    return qwen3_moe.per_expert(out, arch)
