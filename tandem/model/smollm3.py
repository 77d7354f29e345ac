"""SmolLM3 (transformers' SmolLM3ForCausalLM, llama.cpp's smollm3): the Llama family's layers, every
fourth of them without RoPE (NoPE)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.model import arch as llama_arch
from tandem.model.arch import ArchConfig

HF_ARCHITECTURES = ("SmolLM3ForCausalLM",)
GGUF_ARCHITECTURE = "smollm3"
NO_ROPE_INTERVAL = 4  # transformers' default no_rope_layer_interval, and what llama.cpp assumes


def _every_fourth_without(layers: int, interval: int) -> tuple[bool, ...]:
    return tuple((i + 1) % interval != 0 for i in range(layers))


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    base = llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context)
    flags = cfg.get("no_rope_layers")  # 1: the layer rotates
    rope_layers = (tuple(bool(f) for f in flags[:base.num_layers]) if flags is not None else
                   _every_fourth_without(base.num_layers, int(cfg.get("no_rope_layer_interval") or NO_ROPE_INTERVAL)))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise NotImplementedError("SmolLM3 with use_sliding_window is not supported yet")
    return replace(base, rope_layers=rope_layers)


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """llama.cpp's smollm3 keys are the Llama family's; its NoPE layers are every fourth (its own rule)."""
    base = llama_arch.llama_shape_from_gguf(meta, GGUF_ARCHITECTURE, has_output_weight, has_qkv_bias)
    return replace(base, rope_layers=_every_fourth_without(base.num_layers, NO_ROPE_INTERVAL))
