"""A model as the cost models see it: how many bytes its weights and KV take and how many FLOPs a
token costs, from a config (HF config.json, the loaded ArchConfig) or a named preset.

Mixture-of-experts models carry their experts (routed per token, shared ones, leading dense layers),
and multi-head latent attention (DeepSeek) its compressed KV row.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (gated: three matrices)
    vocab_size: int
    tie_word_embeddings: bool = False
    weight_bytes_per_param: float = 2.0  # bf16 2, fp8 1, Q4_1 0.625
    kv_bytes_per_element: float = 2.0
    # Mixture of experts (0 experts: a dense model).
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0  # leading layers with a dense MLP
    # Multi-head latent attention: a KV row of kv_lora_rank + qk_rope_dim per layer, and the
    # projections' own sizes (0: ordinary grouped-query attention).
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def attention_params_per_layer(self) -> int:
        h, nh = self.hidden_size, self.num_heads
        if self.kv_lora_rank:
            qk = self.head_dim + self.qk_rope_dim  # head_dim is the no-rope part
            q = h * self.q_lora_rank + self.q_lora_rank * nh * qk if self.q_lora_rank else h * nh * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * nh * (self.head_dim + self.v_head_dim)
            return q + kv + nh * self.v_head_dim * h
        return h * self.head_dim * (2 * nh + 2 * self.num_kv_heads)

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def resident_params(self) -> int:
        """Every weight but the routed experts: what each GPU of an attention-data-parallel pool holds."""
        dense_layers = self.first_dense_layers if self.is_moe else self.num_layers
        shared = self.num_moe_layers * self.num_shared_experts * self.expert_params
        embeddings = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * self.attention_params_per_layer + dense_layers * self.dense_mlp_params + shared
                + embeddings)

    @property
    def routed_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.resident_params + self.routed_params

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    def linear_params_per_token(self) -> int:
        """Weights a token is multiplied with, the LM head aside (it runs for sampled rows only)."""
        dense_layers = self.first_dense_layers if self.is_moe else self.num_layers
        experts = self.num_moe_layers * (self.experts_per_token + self.num_shared_experts) * self.expert_params
        return self.num_layers * self.attention_params_per_layer + dense_layers * self.dense_mlp_params + experts

    @property
    def kv_bytes_per_token(self) -> float:
        row = self.kv_lora_rank + self.qk_rope_dim if self.kv_lora_rank else 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * row * self.kv_bytes_per_element

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs for one query token against one context token, over all layers (q.k and p.v)."""
        if self.kv_lora_rank:  # absorbed MLA: scores over the latent + rope row, values from the latent
            per_head = 2 * (self.kv_lora_rank + self.qk_rope_dim) + 2 * self.kv_lora_rank
        else:
            per_head = 4 * self.head_dim
        return self.num_layers * self.num_heads * per_head

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        return cls(**data)


def from_hf_config(cfg: dict[str, Any], name: str = "model", weight_bytes_per_param: float = 2.0) -> ModelShape:
    """A HF config.json's dict (Llama, Qwen, Mistral, DeepSeek-V2/V3 keys)."""
    heads = cfg["num_attention_heads"]
    mla = bool(cfg.get("kv_lora_rank"))
    return ModelShape(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("qk_nope_head_dim") if mla else (cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        weight_bytes_per_param=weight_bytes_per_param,
        num_experts=cfg.get("n_routed_experts") or cfg.get("num_experts") or 0,
        experts_per_token=cfg.get("num_experts_per_tok") or 0,
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        first_dense_layers=cfg.get("first_k_dense_replace") or 0,
        kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        qk_rope_dim=cfg.get("qk_rope_head_dim") or 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        v_head_dim=cfg.get("v_head_dim") or 0,
    )


PRESETS: dict[str, ModelShape] = {
    # DistServe's 13B class (OPT-13B there): Llama-2-13B's shape, bf16.
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama-8b": ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    # DeepSeek-V3 (671B, 37B active): fp8 weights, MLA with a 576-wide latent KV row (bf16).
    "deepseek-v3": ModelShape("deepseek-v3", 61, 7168, 128, 128, 128, 18432, 129280, weight_bytes_per_param=1.0,
                              num_experts=256, experts_per_token=8, num_shared_experts=1, moe_intermediate_size=2048,
                              first_dense_layers=3, kv_lora_rank=512, qk_rope_dim=64, q_lora_rank=1536,
                              v_head_dim=128),
}


def model_shape(name_or_path: str, weight_bytes_per_param: float | None = None) -> ModelShape:
    """A preset's name, or a config.json (or a directory holding one)."""
    if name_or_path in PRESETS:
        shape = PRESETS[name_or_path]
    else:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        shape = from_hf_config(json.loads(path.read_text()), path.parent.name or path.stem)
    if weight_bytes_per_param is not None:
        shape = replace(shape, weight_bytes_per_param=weight_bytes_per_param)
    return shape
