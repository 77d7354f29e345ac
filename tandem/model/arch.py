"""The shape of a model (ArchConfig), and how the Llama family's is read from a HF config.json or
from GGUF metadata; other families read theirs in their own module (model/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.model.rope import rope_from_gguf, rope_from_hf

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3 | gemma3 (model/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; and every family whose config sets attention_bias
    o_bias: bool = False  # attention_bias also puts a bias on o_proj (Llama, Granite, OLMo 2; not Qwen2)
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    # Every token that ends a generation (Llama 3.x Instruct declares three; gpt-oss two).
    eos_token_ids: tuple[int, ...] = ()
    # Per layer, its attention's sliding window (0: global); empty: every layer is global.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float = 10000.0  # the RoPE base of the sliding-window layers (Gemma 3)
    rope_scaling_factor: float = 1.0  # linear RoPE scaling of the global layers
    # Each rotary pair's frequency divisor (Llama 3's scaling, model/rope.py); empty: none.
    rope_freq_factors: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (YaRN, longrope)
    rotary_dim: int = 0  # the first this many dimensions of each head rotate (partial rotary); 0: all
    # Per layer, whether it rotates q and k (SmolLM3 leaves every fourth layer without RoPE); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    residual_scale: float = 1.0  # each attention and MLP output scaled before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    attn_scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)
    final_softcap: float = 0.0  # > 0: logits capped at softcap * tanh(logit / softcap)
    hidden_act: str = "silu"  # the gated MLP's activation
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    # Mixture of experts (model/moe.py; 0 experts: every layer's MLP is dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts
    moe_bias: bool = False  # the router and every expert projection have a bias (gpt-oss)
    # > 0: the experts' activation is gpt-oss's clamped SwiGLU (model/moe.py clamped_swiglu): gate
    # clamped above and up on both sides at this limit, out = (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # A learned logit per query head that joins each softmax's denominator and attends to nothing
    # (gpt-oss's attention sinks).
    attn_sinks: bool = False
    # Expert slots this process holds (model/tensor_parallel.py: fewer than num_experts under expert
    # parallelism, plus spare slots for replicas of hot experts); 0: one slot per expert.
    expert_slots: int = 0
    # Under tensor parallelism, the token ids whose embedding and head rows this process holds
    # ([start, end)); None: all of them.
    vocab_shard: tuple[int, int] | None = None

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def rotates(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    @property
    def rope_dim(self) -> int:
        """The rotated dimensions of each head."""
        return self.rotary_dim or self.head_dim

    @property
    def local_vocab(self) -> int:
        """Rows of the embedding and the head held here."""
        return self.vocab_shard[1] - self.vocab_shard[0] if self.vocab_shard else self.vocab_size

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer in self.sparse_layers

    @property
    def num_expert_slots(self) -> int:
        return self.expert_slots or self.num_experts

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def layer_windows(layer_types: list[str] | None, num_layers: int, window: int, pattern: int) -> tuple[int, ...]:
    """Each layer's window from a config's layer_types (sliding_attention | full_attention), or where it
    names none, every pattern-th layer global and the rest sliding (Gemma 3: 6, gpt-oss: 2)."""
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of {num_layers} layers")
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def token_ids(*values: Any) -> tuple[int, ...]:
    """Token ids from config values that are an id, a list of ids or None, in order, each once."""
    out: list[int] = []
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if t is not None and int(t) not in out:
                out.append(int(t))
    return tuple(out)


def gguf_end_tokens(meta: dict[str, Any]) -> tuple[int, ...]:
    """A GGUF file's end tokens: its eos, and the end-of-turn and end-of-message ids llama.cpp's converter
    writes from the tokenizer's special tokens."""
    return token_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))


def arch_from_hf_config(cfg: dict[str, Any], context: int | None = None) -> ArchConfig:
    """context: the deployment's (--max-model-len), for the RoPE scalings that depend on it (rope.py)."""
    archs = cfg.get("architectures") or []
    known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known:
        raise ValueError(f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    arch = known[0]
    window = int(cfg.get("sliding_window") or 0) if arch == "mistral" else 0
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = rope_from_hf(cfg, head_dim, context)
    return ArchConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.theta,
        rope_scaling_factor=rope.linear_factor,
        rope_freq_factors=rope.freq_factors,
        rope_attention_factor=rope.attention_factor,
        rotary_dim=rope.rotary_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=token_ids(cfg.get("eos_token_id")),
        layer_windows=(window,) * cfg["num_hidden_layers"] if window else (),
    )


def llama_shape_from_hf(cfg: dict[str, Any], architecture: str, context: int | None = None,
                        like: str = "LlamaForCausalLM") -> ArchConfig:
    """A config.json read as the Llama family's `like` reads it, under another family's name (the GGUF
    architecture its registry entry serves); families built on the Llama family's (phi3.py,
    granite.py, ...) replace what their own keys add."""
    return replace(arch_from_hf_config({**cfg, "architectures": [like]}, context), architecture=architecture)


GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def arch_from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    return llama_shape_from_gguf(meta, arch, has_output_weight, has_qkv_bias)


def llama_shape_from_gguf(meta: dict[str, Any], arch: str, has_output_weight: bool, has_qkv_bias: bool) -> ArchConfig:
    """A Llama-shaped model from llama.cpp's `<arch>.*` metadata keys; families built on the Llama
    family's (phi3.py, granite.py, ...) replace what their own keys add."""

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    # Not rope.dimension_count: it is narrower than a head under partial rotary (rope.py).
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    context = int(get("context_length", 4096))
    rope = rope_from_gguf(meta, arch, head_dim, context)
    return ArchConfig(
        architecture=GGUF_ARCHITECTURES.get(arch, arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling_factor=rope.linear_factor,
        rope_freq_factors=rope.freq_factors,
        rope_attention_factor=rope.attention_factor,
        rotary_dim=rope.rotary_dim,
        max_position_embeddings=context,
        tie_word_embeddings=not has_output_weight,
        qkv_bias=has_qkv_bias,
        qk_norm=arch == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_tokens(meta),
    )
