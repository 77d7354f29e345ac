"""What a step costs: the shape of a scheduled step, and the models that price it.

`StepShape` is what a step's cost depends on: tokens computed, rows sampled, attention work of
multi-token queries (pairs of query and context tokens) and KV read by single-token queries.
`FittedCost` is a model fitted to steps measured on a live engine (`tandem profile`);
`RooflineCost` prices a step from a GPU's data sheet and a model's shape, with tensor parallelism.
Both serialise into one profile JSON, which the simulator and `tandem plan` read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.sim.colocation import Neighbours
from tandem.sim.hardware import Hardware
from tandem.sim.model_shape import ModelShape

# Token counts where a measured step's cost bends (the quantized kernel gives way to a GEMM, tiles
# fill): a piecewise-linear term in the tokens has a knot at each.
DEFAULT_KNOTS = (16, 64, 128, 256, 512)


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0  # rows that reach their request's end: each gets logits
    prefill_pairs: float = 0.0  # Σ over multi-token queries of n·context + n(n+1)/2
    decode_context: float = 0.0  # Σ over single-token queries of the tokens attended (context + 1)
    num_decode: int = 0

    @classmethod
    def of(cls, items: Iterable[tuple[int, int, int]]) -> StepShape:
        """items: (new tokens, tokens computed before this step, rows sampled: 1 or True at a request's
        end, a verification's drafts plus one)."""
        tokens = seqs = sampled = decode = 0
        pairs = context = 0.0
        for n, computed, samples in items:
            tokens += n
            seqs += 1
            sampled += samples
            if n == 1:
                decode += 1
                context += computed + 1
            else:
                pairs += n * computed + n * (n + 1) / 2
        return cls(tokens, seqs, sampled, pairs, context, decode)


class CostModel(Protocol):
    kind: str

    def step_time(self, shape: StepShape) -> float: ...

    def transfer_time(self, num_bytes: float) -> float: ...

    def kv_capacity_tokens(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> float: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_devices(self) -> int: ...

    @property
    def hop_s(self) -> float: ...

    engine: dict[str, Any]
    neighbours: Neighbours | None  # how a step slows beside another instance's on the same host

    def to_json(self) -> dict[str, Any]: ...


def features(shape: StepShape, knots: Sequence[int]) -> list[float]:
    t = shape.num_tokens
    return [1.0, t, *(max(0.0, t - k) for k in knots), shape.num_sampled, shape.prefill_pairs, shape.decode_context]


@dataclass
class TransferFit:
    latency_s: float
    bandwidth: float  # bytes/s

    def time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


@dataclass
class FittedCost:
    """t = a + b·T + Σ_k c_k·max(0, T - k) + s·sampled + p·prefill_pairs + d·decode_context, fitted to
    measured steps (relative error), plus the engine's per-message hop and the KV transports'
    latency and bandwidth as measured."""

    coefficients: list[float]
    knots: list[int]
    kv_bytes_per_token_: float
    num_layers_: int
    kv_tokens: int  # the pool's capacity in tokens, as the engine sized it
    transports: dict[str, TransferFit] = field(default_factory=dict)
    transport: str = "shm"
    hop_s: float = 0.0  # one message between processes (router <-> worker), measured
    min_step_s: float = 1e-4
    meta: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # the profiled engine's scheduler settings
    # What serving adds to a step (calibrate.py): [scale, overhead_s, per_seq_s]; None: the engine alone.
    serving: list[float] | None = None
    neighbours: Neighbours | None = None  # measured by `tandem profile` beside a neighbour process
    kind: str = "fitted"

    def step_time(self, shape: StepShape, serving: bool = True) -> float:
        if shape.num_tokens == 0:
            return 0.0
        x = features(shape, self.knots)
        t = max(float(np.dot(self.coefficients, x)), self.min_step_s)
        if serving and self.serving is not None:
            scale, overhead, per_seq = self.serving
            t = scale * t + overhead + per_seq * shape.num_seqs
        return t

    def transfer_time(self, num_bytes: float) -> float:
        fit = self.transports.get(self.transport)
        if fit is None:
            raise ValueError(f"the profile measured no {self.transport!r} transport ({', '.join(self.transports)})")
        return fit.time(num_bytes)

    def kv_capacity_tokens(self) -> int:
        return self.kv_tokens

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_token_

    @property
    def num_layers(self) -> int:
        return self.num_layers_

    @property
    def num_devices(self) -> int:
        return 1

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "coefficients": self.coefficients, "knots": self.knots,
                "kv_bytes_per_token": self.kv_bytes_per_token_, "num_layers": self.num_layers_,
                "kv_tokens": self.kv_tokens, "hop_s": self.hop_s, "transport": self.transport,
                "transports": {k: vars(v) for k, v in self.transports.items()}, "min_step_s": self.min_step_s,
                "meta": self.meta, "engine": self.engine, "serving": self.serving,
                "neighbours": None if self.neighbours is None else self.neighbours.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FittedCost:
        return cls(list(d["coefficients"]), list(d["knots"]), d["kv_bytes_per_token"], d["num_layers"],
                   d["kv_tokens"], {k: TransferFit(**v) for k, v in d.get("transports", {}).items()},
                   d.get("transport", "shm"), d.get("hop_s", 0.0), d.get("min_step_s", 1e-4), d.get("meta", {}),
                   d.get("engine", {}), d.get("serving"), Neighbours.from_json(d.get("neighbours")))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (Lawson-Hanson active set): step time never
    falls as work is added, so no fitted slope may be negative."""
    n = a.shape[1]
    x = np.zeros(n)
    passive: list[int] = []
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        active = [j for j in range(n) if j not in passive]
        if not active or max(w[j] for j in active) <= 1e-12:
            break
        passive.append(max(active, key=lambda j: w[j]))
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if all(z[j] > 0 for j in passive):
                x = z
                break
            ratios = [x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0]
            alpha = min(ratios)
            x = x + alpha * (z - x)
            passive = [j for j in passive if x[j] > 1e-15]
    return x


def fit_steps(shapes: Sequence[StepShape], seconds: Sequence[float],
              knots: Sequence[int] = DEFAULT_KNOTS) -> list[float]:
    """Coefficients minimising relative error over measured steps. The hinge terms may bend the
    token slope down (a GEMM past the kernel's rows is cheaper per token), so only they are free in
    sign; the rest are non-negative."""
    x = np.asarray([features(s, knots) for s in shapes], dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-6)
    xw, yw = x * w[:, None], y * w
    # Hinges free in sign: split each into a positive and a negative column for the NNLS.
    hinge = list(range(2, 2 + len(knots)))
    xs = np.concatenate([xw, -xw[:, hinge]], axis=1)
    scale = np.maximum(np.abs(xs).max(axis=0), 1e-30)
    coef = nnls(xs / scale, yw) / scale
    out = coef[: x.shape[1]].copy()
    out[hinge] -= coef[x.shape[1]:]
    return out.tolist()


@dataclass
class RooflineCost:
    """A step on `tp` GPUs of one kind: the larger of its FLOPs over the achievable FLOP/s and its
    bytes (weights, plus the KV it reads) over the achievable bandwidth, plus two all-reduces per
    layer over NVLink and a fixed per-step overhead. For a mixture of experts, only the experts the
    step's tokens touch are read (E·(1 - (1 - k/E)^T) per layer)."""

    hardware: Hardware
    model: ModelShape
    tp: int = 1
    kv_link: str = "inter"  # where a prefill's KV goes: "intra" (same node, NVLink) or "inter" (RDMA)
    memory_fraction: float = 0.9
    # A GPU engine's usual scheduler settings (vLLM's chunked-prefill budget and batch cap).
    engine: dict[str, Any] = field(default_factory=lambda: {"max_num_batched_tokens": 2048, "max_num_seqs": 256,
                                                            "max_model_len": 16384})
    neighbours: Neighbours | None = None  # GPUs of a node share no compute: no slowdown modelled
    kind: str = "roofline"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tp > self.hardware.gpus_per_node:
            raise ValueError(f"tensor parallelism {self.tp} must be 1..{self.hardware.gpus_per_node} (one node)")

    def _flops_per_s(self) -> float:
        peak = self.hardware.fp8_flops if self.model.weight_bytes_per_param <= 1 else self.hardware.flops
        return peak * self.hardware.compute_efficiency * self.tp

    def step_time(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        m, hw = self.model, self.hardware
        linear = 2 * m.linear_params_per_token() * shape.num_tokens + 2 * m.lm_head_params * shape.num_sampled
        attention = m.attention_flops_per_pair * (shape.prefill_pairs + shape.decode_context)
        compute = linear / self._flops_per_s() + attention / (hw.flops * hw.compute_efficiency * self.tp)
        weights = m.resident_params
        if m.is_moe:
            touched = m.num_experts * (1 - (1 - m.experts_per_token / m.num_experts) ** shape.num_tokens)
            weights += m.num_moe_layers * touched * m.expert_params
        kv_read = m.kv_bytes_per_token * (shape.decode_context + shape.prefill_pairs / max(shape.num_tokens, 1))
        memory = (weights * m.weight_bytes_per_param + kv_read) / (hw.mem_bandwidth * hw.memory_efficiency * self.tp)
        comm = 2 * m.num_layers * hw.intra_node.all_reduce_seconds(shape.num_tokens * m.hidden_size * 2, self.tp)
        return max(compute, memory) + comm + hw.step_overhead_s

    def transfer_time(self, num_bytes: float) -> float:
        link = self.hardware.intra_node if self.kv_link == "intra" else self.hardware.inter_node
        # The KV of a tp instance leaves over its tp GPUs' links at once.
        return link.latency_s + num_bytes / (link.bandwidth * self.tp)

    def kv_capacity_tokens(self) -> int:
        free = self.hardware.mem_bytes * self.memory_fraction * self.tp - self.model.weight_bytes
        if free <= 0:
            return 0
        return int(free // self.model.kv_bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def num_devices(self) -> int:
        return self.tp

    @property
    def hop_s(self) -> float:
        return 50e-6

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "hardware": self.hardware.to_json(), "model": self.model.to_json(), "tp": self.tp,
                "kv_link": self.kv_link, "memory_fraction": self.memory_fraction, "engine": self.engine}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RooflineCost:
        out = cls(Hardware.from_json(d["hardware"]), ModelShape.from_json(d["model"]), d.get("tp", 1),
                  d.get("kv_link", "inter"), d.get("memory_fraction", 0.9))
        out.engine.update(d.get("engine", {}))
        return out


def cost_from_json(d: dict[str, Any]) -> FittedCost | RooflineCost:
    kind = d.get("kind")
    if kind == "fitted":
        return FittedCost.from_json(d)
    if kind == "roofline":
        return RooflineCost.from_json(d)
    raise ValueError(f"a profile's kind is 'fitted' or 'roofline', got {kind!r}")


def load_profile(path: str | Path) -> FittedCost | RooflineCost:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the profile {path}: {e}") from None
    return cost_from_json(data)


def save_profile(cost: FittedCost | RooflineCost, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cost.to_json(), indent=2) + "\n")

