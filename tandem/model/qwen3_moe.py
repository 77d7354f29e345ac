"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM; Mixtral's layout with Qwen3's q/k norm): the Llama
family's attention and dense MLPs, and a mixture of experts (model/moe.py) in the sparse layers.

Checkpoints store each expert's gate/up/down projections separately (HF: `mlp.experts.E.gate_proj`)
or stacked (GGUF: `ffn_gate_exps` [experts, intermediate, hidden]); both become the model's slots
(w13 = gate and up, w2 = down), as many as this process holds (model/tensor_parallel.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from tandem.model import arch as llama_arch
from tandem.model.arch import ArchConfig
from tandem.model.causal_lm import CausalLM, Methods
from tandem.model.layers import GatedMLP
from tandem.model.linear import DENSE, Weight
from tandem.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tandem.model.moe import SparseMoE
from tandem.model.quant import QuantizedWeight

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURE = "qwen3moe"


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    base = llama_arch.llama_shape_from_hf(cfg, GGUF_ARCHITECTURE, context, like="Qwen3ForCausalLM")
    layers = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0)
    return replace(base, num_experts=experts,
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised."""
    prefix = f"{GGUF_ARCHITECTURE}."
    qwen3 = {("qwen3." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in meta.items()}
    qwen3["general.architecture"] = "qwen3"
    expert_ff = int(meta[f"{prefix}expert_feed_forward_length"])
    qwen3.setdefault("qwen3.feed_forward_length", expert_ff)
    base = llama_arch.arch_from_gguf_metadata(qwen3, has_output_weight, has_qkv_bias)
    return replace(base, architecture=GGUF_ARCHITECTURE, num_experts=int(meta[f"{prefix}expert_count"]),
                   num_experts_per_tok=int(meta[f"{prefix}expert_used_count"]), moe_intermediate_size=expert_ff,
                   norm_topk_prob=bool(meta.get(f"{prefix}expert_weights_norm", True)),
                   sparse_layers=tuple(range(base.num_layers)))


GGUF_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_STACKED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def per_expert(weights: dict[str, Weight], arch: ArchConfig) -> dict[str, Weight]:
    """Stacked expert tensors ([experts, out, in], biases [experts, out]) as one tensor per expert, as
    HF names them (arch: unused, each stack knows its experts)."""
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = w
            continue
        parts = w.unstack() if isinstance(w, QuantizedWeight) else list(w)
        for e, part in enumerate(parts):
            out[f"layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}.{m.group(3)}"] = part
    return out


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods, layer: int) -> None:
        super().__init__(cfg, dtype, methods, layer)
        if cfg.is_sparse(layer):
            pre = f"layers.{layer}.mlp.experts."
            self.mlp: GatedMLP | SparseMoE = SparseMoE(cfg, dtype, methods.get(f"{pre}w13", DENSE),
                                                       methods.get(f"{pre}w2", DENSE))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    @staticmethod
    def weight_parts(cfg: ArchConfig) -> dict[str, list[str]]:
        parts = CausalLM.weight_parts(cfg)
        for i in cfg.sparse_layers:
            del parts[f"layers.{i}.mlp.gate_up_proj"], parts[f"layers.{i}.mlp.down_proj"]
        return parts

    @staticmethod
    def expert_parts(cfg: ArchConfig) -> dict[str, list[str]]:
        parts = {}
        for i in cfg.sparse_layers:
            pre = f"layers.{i}.mlp.experts."
            slots = range(cfg.num_expert_slots)
            parts[f"{pre}w13"] = [f"{pre}{j}.{p}_proj.weight" for j in slots for p in ("gate", "up")]
            parts[f"{pre}w2"] = [f"{pre}{j}.down_proj.weight" for j in slots]
        return parts

    def load_weights(self, weights: Mapping[str, Weight]) -> None:
        """Experts into slots: slot j is expert j of the checkpoint as this process sees it (its own
        experts, renumbered, under expert parallelism); spare slots start empty. Biases (gpt-oss) go
        into their slots the same way."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        for i in self.cfg.sparse_layers:
            moe = self.layers[i].mlp
            pre = f"layers.{i}.mlp.experts."
            # Straight into the module's own stacks (a 20B model's experts are 10 GB: never a second copy).
            slots = {"w13": moe.w13.data, "w2": moe.w2.data}
            if moe.b13 is not None and moe.b2 is not None:
                slots |= {"b13": moe.b13.data, "b2": moe.b2.data}
            for t in slots.values():
                t.zero_()
            for j in range(moe.slots):
                for kind in ("weight", "bias") if "b13" in slots else ("weight",):
                    names = [f"{pre}{j}.{p}_proj.{kind}" for p in ("gate", "up", "down")]
                    if names[0] not in weights:
                        continue
                    gate, up, down = (weights.pop(n) for n in names)
                    if kind == "weight":  # as each stack is held: the file's blocks, or dense
                        moe.method13.fill(slots["w13"][j], [gate, up])
                        moe.method2.fill(slots["w2"][j], [down])
                    else:
                        DENSE.fill(slots["b13"][j], [gate, up])
                        DENSE.fill(slots["b2"][j], [down])
            for name, t in slots.items():  # loaded already: the parameter itself, which copy_ skips
                weights[f"{pre.removesuffix('experts.')}{name}"] = t
        super().load_weights(weights)
