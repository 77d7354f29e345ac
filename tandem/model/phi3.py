"""Phi-3 / Phi-3.5 / Phi-4-mini (transformers' Phi3ForCausalLM, llama.cpp's phi3): the Llama family's
layers with q/k/v and gate/up stored fused, longrope, and (Phi-4-mini) a partial rotary.

The fused tensors are split into the Llama family's names at load (rows of blocks, for a GGUF file
served as stored), so tensor parallelism and the linear plans see one layout for every family.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from tandem.model import arch as llama_arch
from tandem.model.arch import ArchConfig
from tandem.model.linear import Weight, weight_rows

HF_ARCHITECTURES = ("Phi3ForCausalLM",)
GGUF_ARCHITECTURE = "phi3"
# llama.cpp's converter keeps the fused tensors: attn_qkv, and ffn_up holding gate then up.
GGUF_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_FUSED = re.compile(r"^(?P<pre>(?:model\.)?layers\.\d+\.)(?P<name>self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def _windows(arch: ArchConfig, window: int | None) -> tuple[int, ...]:
    """Phi-3's sliding window over every layer (transformers applies it; Phi-4 sets none)."""
    return (int(window),) * arch.num_layers if window and window < arch.max_position_embeddings else ()


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    base = llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context)
    return replace(base, layer_windows=_windows(base, cfg.get("sliding_window")))


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """llama.cpp's phi3 keys: rope.dimension_count narrower than a head for a partial rotary; longrope's
    factors come as tensors (loader.py)."""
    base = llama_arch.llama_shape_from_gguf(meta, GGUF_ARCHITECTURE, has_output_weight, has_qkv_bias)
    return replace(base, layer_windows=_windows(base, meta.get(f"{GGUF_ARCHITECTURE}.attention.sliding_window")))


def split_fused(weights: dict[str, Weight], arch: ArchConfig) -> dict[str, Weight]:
    """qkv_proj into q/k/v_proj, gate_up_proj into gate/up_proj (rows; dense or in blocks)."""
    out: dict[str, Weight] = {}
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    for name, w in weights.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = w
            continue
        pre = m.group("pre")
        if m.group("name") == "self_attn.qkv_proj":
            bounds = {"self_attn.q_proj": (0, q), "self_attn.k_proj": (q, q + kv),
                      "self_attn.v_proj": (q + kv, q + 2 * kv)}
        else:
            bounds = {"mlp.gate_proj": (0, inter), "mlp.up_proj": (inter, 2 * inter)}
        if w.shape[0] != max(end for _, end in bounds.values()):
            raise ValueError(f"{name} has {w.shape[0]} rows, expected {max(end for _, end in bounds.values())}")
        for part, (start, end) in bounds.items():
            out[f"{pre}{part}.weight"] = weight_rows(w, start, end)
    return out
