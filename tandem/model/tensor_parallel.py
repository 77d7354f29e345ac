"""How a model is cut into the shards of a worker group (Megatron-style), and each shard's weights.

Tensor parallelism splits every layer across the ranks: q/k/v and gate/up by output rows (column
parallel: each rank computes its heads and its part of the intermediate), o_proj and down_proj by
input columns (row parallel: each rank's partial sum, then one all-reduce). Heads are split by KV
head groups, contiguous, the first ranks taking the larger share when they do not divide (the
default model's 3 KV heads over 2 ranks: 2 and 1), so rank 0's KV pool is the largest and the
block count it computes fits every rank. Fewer KV heads than ranks: each KV head is held by
size / num_kv_heads ranks, which split its query heads.

The vocabulary is split too: each rank holds its token ids' rows of the embedding (a lookup of the
others is zero, and an all-reduce sums the ranks') and of the head (its logits columns, gathered).

Expert parallelism gives each rank whole experts (contiguous) instead of a slice of every expert,
plus spare slots that hold replicas of hot experts (EPLB, model/moe.py). Norms and the router are
whole on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tandem.model.arch import ArchConfig
from tandem.model.linear import Weight, weight_rows
from tandem.model.quant import QuantizedWeight, slice_weight


@dataclass(frozen=True)
class Shard:
    """This process's place in a worker group of size ranks."""

    rank: int = 0
    size: int = 1
    tensor_parallel: bool = True  # attention and dense MLPs split (else whole on every rank)
    expert_parallel: bool = False  # experts spread over the ranks (else each expert split, when tensor_parallel)
    spare_slots: int = 0  # expert slots per rank beyond its share, for replicas (EPLB)
    eplb_interval: int = 64  # forward calls per expert-load window (and between rebalances)

    @property
    def splits_layers(self) -> bool:
        return self.size > 1 and self.tensor_parallel

    @property
    def splits_experts(self) -> bool:
        return self.size > 1 and self.tensor_parallel and not self.expert_parallel


def split_range(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """The index-th of parts contiguous ranges covering [0, n), in whole units, the first ones larger."""
    units = n // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    return start * unit, (start + base + (index < extra)) * unit


def _unit(n: int, parts: int) -> int:
    """The split's granularity: ggml's 256- or 32-weight blocks where that still gives each part some,
    so quantized row-parallel weights split without dequantizing."""
    return next((u for u in (256, 32) if n % u == 0 and n // u >= parts), 1)


def head_ranges(arch: ArchConfig, shard: Shard) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) of this rank."""
    h, g, n, r = arch.num_heads, arch.num_kv_heads, shard.size, shard.rank
    if not shard.splits_layers:
        return (0, h), (0, g)
    per = h // g
    if g >= n:
        kv = split_range(g, n, r)
        return (kv[0] * per, kv[1] * per), kv
    if n % g or per % (n // g):
        raise ValueError(f"{h} attention heads with {g} KV heads do not split over {n} ranks")
    share = n // g  # ranks per KV head
    head, part = divmod(r, share)
    q0 = head * per + part * (per // share)
    return (q0, q0 + per // share), (head, head + 1)


def expert_share(arch: ArchConfig, shard: Shard) -> tuple[int, int]:
    """The experts rank holds in its first slots (expert parallelism; all experts otherwise)."""
    if shard.size > 1 and shard.expert_parallel:
        return split_range(arch.num_experts, shard.size, shard.rank)
    return 0, arch.num_experts


def slots_per_rank(arch: ArchConfig, shard: Shard) -> int:
    if shard.size > 1 and shard.expert_parallel:
        return -(-arch.num_experts // shard.size) + shard.spare_slots
    return arch.num_experts


def shard_arch(arch: ArchConfig, shard: Shard) -> ArchConfig:
    """This rank's shape: its heads, its part of each intermediate, its expert slots."""
    (q0, q1), (k0, k1) = head_ranges(arch, shard)
    changes: dict = dict(num_heads=q1 - q0, num_kv_heads=k1 - k0)
    if shard.splits_layers:
        i0, i1 = split_range(arch.intermediate_size, shard.size, shard.rank, _unit(arch.intermediate_size, shard.size))
        changes["intermediate_size"] = i1 - i0
        changes["vocab_shard"] = split_range(arch.vocab_size, shard.size, shard.rank)
    if arch.num_experts:
        if shard.splits_experts:
            m = arch.moe_intermediate_size
            m0, m1 = split_range(m, shard.size, shard.rank, _unit(m, shard.size))
            changes["moe_intermediate_size"] = m1 - m0
        changes["expert_slots"] = slots_per_rank(arch, shard)
    return replace(arch, **changes)


def _cols(w: Weight, c: tuple[int, int]) -> Weight:
    if isinstance(w, QuantizedWeight):
        try:
            return slice_weight(w, cols=c)
        except ValueError:  # not on block boundaries: this shard is held dequantized
            w = w.dequantize()
    return w[:, c[0]:c[1]].contiguous()


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def shard_weights(weights: dict[str, Weight], arch: ArchConfig, shard: Shard) -> dict[str, Weight]:
    """This rank's part of every HF-named weight ("model." already stripped or not). Expert weights
    are per expert (model/moe.py's loader names fused ones that way first) and renamed to this
    rank's slots."""
    if shard.size == 1:
        return weights
    (q0, q1), (k0, k1) = head_ranges(arch, shard)
    d = arch.head_dim
    parts = {"q_proj": (q0 * d, q1 * d), "k_proj": (k0 * d, k1 * d), "v_proj": (k0 * d, k1 * d)}
    inter = split_range(arch.intermediate_size, shard.size, shard.rank, _unit(arch.intermediate_size, shard.size))
    moe = split_range(arch.moe_intermediate_size, shard.size, shard.rank,
                      _unit(arch.moe_intermediate_size, shard.size)) if arch.num_experts else (0, 0)
    e0, e1 = expert_share(arch, shard)
    out: dict[str, Weight] = {}
    for full, w in weights.items():
        name = full.removeprefix("model.")
        m = _LAYER.match(name)
        if m is None:
            if shard.splits_layers and name in ("embed_tokens.weight", "lm_head.weight"):
                w = weight_rows(w, *split_range(arch.vocab_size, shard.size, shard.rank))  # vocab-parallel
            out[full] = w
            continue
        rest = m.group(2)
        expert = _EXPERT.match(rest)
        if expert is not None:
            e, kind, part = int(expert.group(1)), expert.group(2), expert.group(3)
            if not e0 <= e < e1:
                continue
            if shard.splits_experts:
                if part == "bias":  # each rank would add down's bias to its partial sum
                    raise ValueError("experts with biases split over ranks are not supported: use expert parallelism")
                w = _cols(w, moe) if kind == "down_proj" else weight_rows(w, *moe)
            out[f"layers.{m.group(1)}.mlp.experts.{e - e0}.{kind}.{part}"] = w
            continue
        if shard.splits_layers:
            module, _, kind = rest.rpartition(".")
            proj = module.rsplit(".", 1)[-1]
            if proj in parts:
                w = weight_rows(w, *parts[proj])
            elif proj == "o_proj":
                if kind == "bias":
                    raise ValueError("a row-parallel o_proj with a bias is not supported")
                w = _cols(w, parts["q_proj"])
            elif module == "mlp.gate_proj" or module == "mlp.up_proj":
                w = weight_rows(w, *inter)
            elif module == "mlp.down_proj":
                w = _cols(w, inter)
        out[full] = w
    return out


def row_parallel(name: str) -> bool:
    """Whether a linear module's output is a partial sum that the ranks all-reduce."""
    return name.endswith("self_attn.o_proj") or name.endswith("mlp.down_proj")

