"""A mixture-of-experts decode pool on many GPUs: attention data-parallel (each GPU its own streams),
experts spread over the pool (expert parallelism), tokens dispatched to their experts and combined
back by all-to-all every MoE layer (DeepSeek-V3's decode deployment).

What it answers: for a width (GPUs in the pool) the largest batch per GPU that meets a TPOT SLO and
fits in memory, the tokens/s per GPU that gives, and what rebalancing a skewed expert load (EPLB:
replicas of hot experts, packed so every GPU gets the same load) and two-micro-batch overlap of the
all-to-all with compute (DBO) recover. Assumptions are fields of `MoEDecode`, stated in its output.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from tandem.sim.hardware import Hardware
from tandem.sim.model_shape import ModelShape


def expert_popularity(num_experts: int, skew: float, seed: int = 0) -> np.ndarray:
    """Share of routed tokens per expert: Zipf-like with exponent `skew` (0: uniform), the hot experts
    at random ids (so a contiguous placement scatters them)."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    weights = ranks ** -skew
    rng = np.random.default_rng(seed)
    return rng.permutation(weights / weights.sum())


def contiguous_loads(popularity: np.ndarray, width: int) -> np.ndarray:
    """Each GPU's share of routed tokens when expert e lives on GPU e // (E / width)."""
    return popularity.reshape(width, -1).sum(axis=1)


def eplb_loads(popularity: np.ndarray, width: int, redundant: int) -> np.ndarray:
    """EPLB's two steps: give `redundant` extra replicas to the experts with the most load per
    replica, then pack replicas (each carrying its expert's load / replicas) onto GPUs, heaviest
    first onto the least-loaded GPU with a free slot."""
    replicas = np.ones_like(popularity, dtype=np.int64)
    heap = [(-p, e) for e, p in enumerate(popularity)]
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-popularity[e] / replicas[e], e))
    pieces = sorted(((popularity[e] / replicas[e], e) for e in range(len(popularity)) for _ in range(replicas[e])),
                    reverse=True)
    slots = len(pieces) // width + (len(pieces) % width > 0)
    loads = np.zeros(width)
    used = np.zeros(width, dtype=np.int64)
    for load, _ in pieces:
        candidates = [g for g in range(width) if used[g] < slots]
        g = min(candidates, key=lambda i: loads[i])
        loads[g] += load
        used[g] += 1
    return loads


@dataclass(frozen=True)
class MoEDecode:
    hardware: Hardware
    model: ModelShape
    width: int  # GPUs in the decode pool (expert-parallel width)
    context: int = 4096  # mean tokens of context per stream
    skew: float = 0.6  # expert popularity's Zipf exponent
    eplb: bool = False
    redundant_per_gpu: int = 1  # EPLB's extra expert slots per GPU
    dbo: bool = False  # two micro-batches: one's all-to-all under the other's compute
    dbo_overhead: float = 0.1  # of the shorter of compute and communication, not hidden
    kv_bytes_per_element: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model.num_experts % self.width:
            raise ValueError(f"{self.model.num_experts} experts do not split over {self.width} GPUs")

    def gpu_loads(self) -> np.ndarray:
        pop = expert_popularity(self.model.num_experts, self.skew, self.seed)
        if self.eplb:
            return eplb_loads(pop, self.width, self.redundant_per_gpu * self.width)
        return contiguous_loads(pop, self.width)

    def imbalance(self) -> float:
        loads = self.gpu_loads()
        return float(loads.max() / loads.mean())

    def experts_per_gpu(self) -> int:
        return self.model.num_experts // self.width + (self.redundant_per_gpu if self.eplb else 0)

    def weight_bytes_per_gpu(self) -> float:
        m = self.model
        routed = m.num_moe_layers * self.experts_per_gpu() * m.expert_params
        return (m.resident_params + routed) * m.weight_bytes_per_param

    def max_batch_by_memory(self) -> int:
        free = self.hardware.mem_bytes * 0.9 - self.weight_bytes_per_gpu()
        per_stream = self.model.kv_bytes_per_token * self.context
        return max(int(free // per_stream), 0)

    def _all_to_all(self, tokens_in: float) -> float:
        """One layer's dispatch (fp8 hidden) and combine (bf16) for the busiest GPU's tokens: the
        share bound for other nodes crosses the NIC, the rest NVLink."""
        hw, m = self.hardware, self.model
        nbytes = tokens_in * m.hidden_size * (1 + 2) * (1 - 1 / self.width)
        off_node = max(self.width - hw.gpus_per_node, 0) / self.width
        on_node = 1 - off_node
        node_link = hw.intra_node_all_to_all or hw.intra_node
        t = max(nbytes * on_node / node_link.bandwidth, nbytes * off_node / hw.inter_node.bandwidth)
        link = hw.inter_node if off_node else node_link
        return t + 2 * link.latency_s

    def step_time(self, batch: int) -> float:
        """One decode step with `batch` streams on every GPU."""
        hw, m = self.hardware, self.model
        fp8 = m.weight_bytes_per_param <= 1
        flops = (hw.fp8_flops if fp8 else hw.flops) * hw.compute_efficiency
        bw = hw.mem_bandwidth * hw.memory_efficiency
        # Attention, dense layers and shared experts: this GPU's own streams.
        dense_params = m.resident_params - m.embedding_params
        attention = m.attention_flops_per_pair * batch * self.context / (hw.flops * hw.compute_efficiency)
        dense = max(2 * dense_params * batch / flops + attention,
                    (dense_params * m.weight_bytes_per_param + batch * self.context * m.kv_bytes_per_token) / bw)
        # Routed experts: the busiest GPU's tokens (every GPU waits for it at the next all-to-all).
        tokens_in = self.gpu_loads().max() * batch * self.width * m.experts_per_token
        experts = self.experts_per_gpu()
        touched = experts * (1 - (1 - 1 / experts) ** tokens_in)
        per_layer_expert = max(2 * m.expert_params * tokens_in / flops,
                               touched * m.expert_params * m.weight_bytes_per_param / bw)
        compute = dense / m.num_layers  # spread over layers
        comm = self._all_to_all(tokens_in)
        moe_layers = m.num_moe_layers
        dense_layers = m.num_layers - moe_layers
        if self.dbo:
            busy = compute + per_layer_expert
            layer = max(busy, comm) + self.dbo_overhead * min(busy, comm)
        else:
            layer = compute + per_layer_expert + comm
        return moe_layers * layer + dense_layers * compute + hw.step_overhead_s

    def best_batch(self, tpot_s: float) -> int:
        """The most streams per GPU whose step meets the TPOT SLO and whose KV fits."""
        hi = self.max_batch_by_memory()
        if hi < 1 or self.step_time(1) > tpot_s:
            return 0
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.step_time(mid) <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def throughput(self, tpot_s: float) -> tuple[int, float, float]:
        """(streams per GPU, step seconds, output tokens/s per GPU) at the SLO."""
        b = self.best_batch(tpot_s)
        if b == 0:
            return 0, float("inf"), 0.0
        t = self.step_time(b)
        return b, t, b / t


@dataclass
class WidthRow:
    width: int
    variant: str  # "contiguous", "eplb", "eplb+dbo"
    imbalance: float
    batch: int
    step_s: float
    tokens_per_gpu: float


VARIANTS = {"contiguous": {"eplb": False, "dbo": False}, "eplb": {"eplb": True, "dbo": False},
            "eplb+dbo": {"eplb": True, "dbo": True}}


def plan_expert_parallel(hardware: Hardware, model: ModelShape, widths: list[int], tpot_s: float,
                         context: int = 4096, skew: float = 0.6) -> list[WidthRow]:
    """Every width and variant at the SLO; the planner's choice is the row with the most tokens/s per
    GPU (ties: the narrower pool)."""
    rows = []
    for width in widths:
        for name, flags in VARIANTS.items():
            pool = MoEDecode(hardware, model, width, context=context, skew=skew, **flags)
            b, t, tps = pool.throughput(tpot_s)
            rows.append(WidthRow(width, name, pool.imbalance(), b, t, tps))
    return rows


def format_width_table(rows: list[WidthRow]) -> str:
    lines = [f"{'EP width':>8}  {'placement':<11} {'max/mean load':>13}  {'streams/GPU':>11}  {'step ms':>8}  "
             f"{'tok/s/GPU':>9}"]
    for r in rows:
        step = f"{r.step_s * 1e3:8.1f}" if r.batch else f"{'-':>8}"
        lines.append(f"{r.width:>8}  {r.variant:<11} {r.imbalance:>13.2f}  {r.batch:>11}  {step}  "
                     f"{r.tokens_per_gpu:>9.0f}")
    return "\n".join(lines)
