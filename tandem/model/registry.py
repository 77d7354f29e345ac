"""The model families Tandem serves, and how each one's checkpoints map onto its modules.

A family is its model class, how its shape is read (config.json or GGUF metadata), the GGUF tensor
names that differ from the Llama family's, and what its checkpoints store differently. A new family
is one more entry here and one module, never a branch in another family's code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.model import arch as llama_arch
from tandem.model import gemma3, gpt_oss, granite, olmo2, phi3, qwen3_moe, smollm3
from tandem.model.arch import ArchConfig
from tandem.model.causal_lm import CausalLM
from tandem.model.gemma3 import Gemma3ForCausalLM
from tandem.model.llama import LlamaForCausalLM
from tandem.model.olmo2 import Olmo2ForCausalLM
from tandem.model.qwen3_moe import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_cls: type[CausalLM]
    hf_architectures: tuple[str, ...]  # config.json "architectures" it serves
    gguf_architectures: tuple[str, ...]  # GGUF general.architecture values it serves
    # (config.json, the deployment's context or None) -> shape; the context fixes the RoPE scalings that
    # depend on a length (rope.py).
    arch_from_hf: Callable[[dict[str, Any], int | None], ArchConfig]
    arch_from_gguf: Callable[[dict[str, Any], bool, bool], ArchConfig]
    # GGUF per-layer tensor names -> HF module names, where they differ from the Llama family's.
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp permutes these GGUF architectures' q/k rows for its interleaved RoPE (undone at load).
    gguf_rope_permuted: tuple[str, ...] = ()
    # Added to a HF checkpoint's norm weights (Gemma stores w for a norm that multiplies by 1 + w).
    hf_norm_offset: float = 0.0
    # The checkpoint's tensors as the model (and a shard plan) names them, once read (MoE: per expert;
    # Phi-3: its fused tensors split).
    prepare_weights: Callable[[dict[str, Any], ArchConfig], dict[str, Any]] | None = None

    def hf_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.hf_norm_offset and name.endswith("norm.weight"):
            return tensor.float() + self.hf_norm_offset
        return tensor


FAMILIES = (
    ModelFamily("llama", LlamaForCausalLM, tuple(llama_arch.SUPPORTED_ARCHITECTURES),
                tuple(llama_arch.GGUF_ARCHITECTURES), llama_arch.arch_from_hf_config,
                llama_arch.arch_from_gguf_metadata, gguf_rope_permuted=("llama", "mistral")),
    ModelFamily("gemma3", Gemma3ForCausalLM, ("Gemma3ForCausalLM",), ("gemma3",), gemma3.arch_from_hf_config,
                gemma3.arch_from_gguf_metadata,
                gguf_layer_names={"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                                  "ffn_norm": "pre_feedforward_layernorm",
                                  "post_ffw_norm": "post_feedforward_layernorm"},
                hf_norm_offset=1.0),
    ModelFamily("qwen3moe", Qwen3MoeForCausalLM, qwen3_moe.HF_ARCHITECTURES, (qwen3_moe.GGUF_ARCHITECTURE,),
                qwen3_moe.arch_from_hf_config, qwen3_moe.arch_from_gguf_metadata,
                gguf_layer_names=qwen3_moe.GGUF_LAYER_NAMES, prepare_weights=qwen3_moe.per_expert),
    ModelFamily("phi3", LlamaForCausalLM, phi3.HF_ARCHITECTURES, (phi3.GGUF_ARCHITECTURE,), phi3.arch_from_hf_config,
                phi3.arch_from_gguf_metadata, gguf_layer_names=phi3.GGUF_LAYER_NAMES, prepare_weights=phi3.split_fused),
    ModelFamily("smollm3", LlamaForCausalLM, smollm3.HF_ARCHITECTURES, (smollm3.GGUF_ARCHITECTURE,),
                smollm3.arch_from_hf_config, smollm3.arch_from_gguf_metadata,
                gguf_rope_permuted=(smollm3.GGUF_ARCHITECTURE,)),
    ModelFamily("granite", LlamaForCausalLM, granite.HF_ARCHITECTURES, (granite.GGUF_ARCHITECTURE,),
                granite.arch_from_hf_config, granite.arch_from_gguf_metadata,
                gguf_rope_permuted=(granite.GGUF_ARCHITECTURE,)),
    ModelFamily("gpt-oss", Qwen3MoeForCausalLM, gpt_oss.HF_ARCHITECTURES, (gpt_oss.GGUF_ARCHITECTURE,),
                gpt_oss.arch_from_hf_config, gpt_oss.arch_from_gguf_metadata, gguf_layer_names=gpt_oss.GGUF_LAYER_NAMES,
                prepare_weights=gpt_oss.prepare_weights),
    ModelFamily("olmo2", Olmo2ForCausalLM, olmo2.HF_ARCHITECTURES, (olmo2.GGUF_ARCHITECTURE,),
                olmo2.arch_from_hf_config, olmo2.arch_from_gguf_metadata, gguf_layer_names=olmo2.GGUF_LAYER_NAMES),
)


def family_for_hf(cfg: dict[str, Any]) -> ModelFamily:
    archs = cfg.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs):
            return family
    known = sorted(a for f in FAMILIES for a in f.hf_architectures)
    raise ValueError(f"unsupported architecture {archs}; supported: {known}")


def family_for_gguf(architecture: str | None) -> ModelFamily:
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    known = sorted(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {known}")


def family_of(arch: ArchConfig) -> ModelFamily:
    """The family that serves a parsed shape (ArchConfig.architecture names a GGUF architecture)."""
    return family_for_gguf(arch.architecture)
