"""A mixture-of-experts MLP (Qwen3-MoE / Mixtral layout): a router picks top-k experts per token,
each expert a gated MLP; experts run as grouped matmuls (the rows of each expert together).

Alone, or with tensor parallelism splitting every expert, each rank runs every token through its
part of the experts (then the group all-reduces, as any row-parallel layer). With expert
parallelism (model/tensor_parallel.py) each rank holds whole experts in slots: a step's tokens are
cut into one slice per rank, each rank routes its slice and sends every (token, expert) row to the
rank holding that expert (all-to-all), the experts run there, the results come back (all-to-all) and
are combined, and the slices are gathered again for the next layer's attention.

Every eplb_interval forward calls the group adds up the window's load (rows per expert, rows per
rank: `load` holds the last window's), and with spare slots (EPLB) places the experts again
(model/eplb.py): hot experts get replicas, whose weights move between ranks in one all-to-all, and
the stream goes on with the next step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.arch import ArchConfig
from tandem.model.eplb import initial_placement, rank_loads, rebalance, replica_table
from tandem.model.linear import DENSE, GGUFMethod, LinearMethod
from tandem.model.quant import QuantizedWeight, quantized_linear
from tandem.model.tensor_parallel import split_range
from tandem.ops import fused


@dataclass
class ExpertLoad:
    """One window of an expert-parallel layer's load."""

    per_expert: list[float] = field(default_factory=list)  # rows routed to each expert
    per_rank: list[float] = field(default_factory=list)  # rows each rank's slots computed
    rebalanced: bool = False  # EPLB placed the experts again at the window's end
    rebalances: int = 0  # the layer's placements since start

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' rows (1.0: perfectly even)."""
        return spread(self.per_rank)


REBALANCE_GAIN = 0.05  # the least fall in max / mean rows per rank that a new placement must bring


def spread(loads: list[float]) -> float:
    """max / mean (1.0: even)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if bias else None


def clamped_swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation over [gate | up] halves: the gate clamped above at limit, up on
    both sides, then (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, method13: LinearMethod = DENSE,
                 method2: LinearMethod = DENSE) -> None:
        """method13, method2: how the gate/up and down stacks are held, as a Linear's method says
        (GGUFMethod: the file's blocks, [slots, rows, row bytes] uint8; dense otherwise)."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.slots, self.intermediate = cfg.num_expert_slots, cfg.moe_intermediate_size
        self.hidden = hidden = cfg.hidden_size
        self.gate = Router(hidden, cfg.num_experts, dtype, cfg.moe_bias)
        self.swiglu_limit, self.swiglu_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        # Slot s: w13[s] = [gate; up] rows, w2[s] = down ([hidden, intermediate]); b13, b2 their biases.
        # A stack is held as one format's blocks or dense (a plan of mixed formats, gguf-split, is dense).
        self.method13, self.method2 = (m if isinstance(m, GGUFMethod) else DENSE for m in (method13, method2))
        self.w13 = self._stack(self.method13, 2 * self.intermediate, hidden, dtype)
        self.w2 = self._stack(self.method2, hidden, self.intermediate, dtype)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if cfg.moe_bias:
            self.b13 = nn.Parameter(torch.empty(self.slots, 2 * self.intermediate, dtype=dtype), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(self.slots, hidden, dtype=dtype), requires_grad=False)
        self.comm: Any | None = None
        self.ranks, self.rank, self.reduce_out = 1, 0, False
        self.spare, self.interval = 0, 64
        self._place(initial_placement(self.num_experts, 1, self.slots))
        self.window_expert = torch.zeros(self.num_experts, dtype=torch.float64, device="cpu")  # not the meta device
        self.window_rows = 0
        self.calls = 0
        self.load = ExpertLoad()  # the last finished window's
        self.rebalances = 0

    def _stack(self, method: LinearMethod, rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
        if isinstance(method, GGUFMethod):
            return nn.Parameter(torch.empty(self.slots, rows, method.fmt.row_bytes(cols), dtype=torch.uint8),
                                requires_grad=False)
        return nn.Parameter(torch.empty(self.slots, rows, cols, dtype=dtype), requires_grad=False)

    def _project(self, x: torch.Tensor, stack: torch.Tensor, method: LinearMethod, slot: int, in_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(method, GGUFMethod):
            return quantized_linear(x, QuantizedWeight(stack[slot], method.fmt, in_features),
                                    None if bias is None else bias[slot], method.int8_activations)
        return F.linear(x, stack[slot], None if bias is None else bias[slot])

    def join_group(self, comm: Any, shard: Any) -> None:
        self.comm = comm
        if shard.expert_parallel:
            self.ranks, self.rank = shard.size, shard.rank
            self.spare, self.interval = shard.spare_slots, shard.eplb_interval
            self._place(initial_placement(self.num_experts, self.ranks, self.slots))
        else:
            self.reduce_out = shard.splits_experts  # each rank ran its slice of every expert

    def _place(self, placement: list[int]) -> None:
        self.placement = placement
        self.replicas, self.num_replicas = replica_table(placement, self.num_experts)

    # -- the step ------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]): softmax in float32, top-k, optionally
        renormalised (transformers' Qwen3-MoE router)."""
        probs = torch.softmax(F.linear(x, self.gate.weight, self.gate.bias).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_experts(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row i through the expert in local slot slots[i]: one matmul pair per expert with rows."""
        out = x.new_empty(x.shape)
        if not len(slots):
            return out
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.slots).tolist()
        start = 0
        for slot, n in enumerate(counts):
            if not n:
                continue
            rows = order[start:start + n]
            h = self._project(x[rows], self.w13, self.method13, slot, self.hidden, self.b13)
            h = clamped_swiglu(h, self.swiglu_limit, self.swiglu_alpha) if self.swiglu_limit else fused.silu_and_mul(h)
            out[rows] = self._project(h, self.w2, self.method2, slot, self.intermediate, self.b2)
            start += n
        return out

    def held_stacks(self) -> list[tuple[str, torch.Tensor]]:
        """The expert stacks by the form they are held in (held_weights.held_forms)."""
        return [(f"{self.method13.name} experts", self.w13), (f"{self.method2.name} experts", self.w2)]

    def slot_tensors(self) -> list[torch.Tensor]:
        """Everything a slot holds, [slots, ...] each: what moves with an expert."""
        return [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ranks > 1:
            out = self._forward_expert_parallel(x)
        else:
            weights, experts = self.route(x)
            self.window_expert += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
            tokens = torch.arange(len(x)).repeat_interleave(self.top_k)
            y = self.run_experts(x[tokens], experts.reshape(-1)) * weights.reshape(-1, 1)
            out = torch.zeros_like(x).index_add_(0, tokens, y)
            if self.reduce_out:
                out = self.comm.all_reduce(out)
        self.calls += 1
        if self.ranks > 1 and self.calls % self.interval == 0:
            self._end_window()
        return out

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        comm, k = self.comm, self.top_k
        t0, t1 = split_range(len(x), self.ranks, self.rank)
        mine = x[t0:t1]
        weights, experts = self.route(mine)
        self.window_expert += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        tokens = torch.arange(len(mine)).repeat_interleave(k)
        flat = experts.reshape(-1)
        # A hot expert's replicas take its rows in turn (by the row's place in the whole step).
        turn = ((tokens + t0) * k + torch.arange(k).repeat(len(mine))) % self.num_replicas[flat]
        slot = self.replicas[flat, turn]
        dest = slot // self.slots
        order = torch.argsort(dest, stable=True)
        sizes = torch.bincount(dest, minlength=self.ranks).tolist()
        sent_slots = list((slot[order] % self.slots).view(-1, 1).split(sizes))
        got_slots = comm.all_to_all(sent_slots)
        got_rows = comm.all_to_all(list(mine[tokens[order]].split(sizes)))
        got = [len(s) for s in got_slots]
        rows = torch.cat(got_rows)
        self.window_rows += len(rows)
        y = self.run_experts(rows, torch.cat(got_slots).view(-1))
        back = torch.cat(comm.all_to_all(list(y.split(got))))
        pairs = torch.empty_like(back)
        pairs[order] = back
        out = torch.zeros_like(mine).index_add_(0, tokens, pairs * weights.reshape(-1, 1))
        return torch.cat(comm.all_gather(out))

    # -- the load window and EPLB ------------------------------------------------------------------
    def _end_window(self) -> None:
        comm = self.comm
        per_expert = comm.all_reduce(self.window_expert.float()).tolist()
        mine = torch.zeros(self.ranks)
        mine[self.rank] = float(self.window_rows)
        per_rank = comm.all_reduce(mine).tolist()
        self.window_expert.zero_()
        self.window_rows = 0
        moved = False
        if self.spare and sum(per_expert):
            placement = rebalance(per_expert, self.ranks, self.slots)
            # Moving experts costs an all-to-all of their weights: only for a real gain on this window.
            if spread(rank_loads(self.placement, per_expert, self.ranks, self.slots)) - \
                    spread(rank_loads(placement, per_expert, self.ranks, self.slots)) > REBALANCE_GAIN:
                self._move_to(placement)
                self.rebalances += 1
                moved = True
        self.load = ExpertLoad(per_expert, per_rank, moved, self.rebalances)

    def _move_to(self, placement: list[int]) -> None:
        """Load every slot of this rank with its new expert: from a slot it holds already, or from the
        lowest rank holding it now (one all-to-all of whole experts' weights and biases)."""
        n, slots, old = self.ranks, self.slots, self.placement
        held = [set(old[r * slots:(r + 1) * slots]) for r in range(n)]
        source = {e: min(r for r in range(n) if e in held[r]) for e in range(self.num_experts)}
        local = {e: j for j, e in enumerate(old[self.rank * slots:(self.rank + 1) * slots]) if e >= 0}
        tensors = self.slot_tensors()
        sizes = [t[0].numel() for t in tensors]
        width = sum(sizes)
        # One dtype on the wire that holds every part exactly (blocks' bytes beside bf16 biases: bf16).
        wire = functools.reduce(torch.promote_types, [t.dtype for t in tensors])

        def needs(d: int, src: int) -> list[int]:  # experts rank d takes from src, in d's slot order
            return [e for e in placement[d * slots:(d + 1) * slots] if e >= 0 and e not in held[d] and source[e] == src]

        def flat(e: int) -> torch.Tensor:
            return torch.cat([t[local[e]].reshape(-1).to(wire) for t in tensors]).view(1, -1)

        sends = [torch.cat([flat(e) for e in needs(d, self.rank)]) if needs(d, self.rank)
                 else self.w13.new_empty(0, width, dtype=wire) for d in range(n)]
        size = torch.empty(0, dtype=wire).element_size()
        largest = max(len(needs(d, s)) for d in range(n) for s in range(n)) * width * size
        received = self.comm.all_to_all(sends, large=largest * n > self.comm.slot_bytes)
        taken = [0] * n
        fresh = [torch.zeros_like(t) for t in tensors]
        for j, e in enumerate(placement[self.rank * slots:(self.rank + 1) * slots]):
            if e < 0:
                continue
            if e in local:
                for new, t in zip(fresh, tensors, strict=True):
                    new[j] = t[local[e]]
                continue
            row = received[source[e]][taken[source[e]]]
            taken[source[e]] += 1
            for new, part in zip(fresh, row.split(sizes), strict=True):
                new[j] = part.view_as(new[j])
        for t, new in zip(tensors, fresh, strict=True):
            t.data = new
        self._place(placement)
