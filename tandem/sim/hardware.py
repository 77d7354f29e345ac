"""Accelerators and links by their data sheets, for analytic cost models.

Peak numbers are dense (no structured sparsity). The efficiencies are what serving engines reach
in practice (large GEMMs at ~60-70% of peak, HBM streams at ~80%); they are assumptions, stated in
the profile a model is built from, and a measured profile replaces them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 1e9


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, one direction, per GPU
    latency_s: float

    def all_reduce_seconds(self, num_bytes: float, n: int) -> float:
        """A ring all-reduce of num_bytes over n ranks."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * num_bytes / self.bandwidth

    def all_to_all_seconds(self, num_bytes: float, n: int) -> float:
        """An all-to-all in which every rank holds num_bytes, (n - 1) / n of them for the others."""
        if n <= 1:
            return 0.0
        return self.latency_s + (1 - 1 / n) * num_bytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # bf16 dense FLOP/s
    fp8_flops: float
    mem_bandwidth: float  # bytes/s
    mem_bytes: float
    intra_node: Link  # between the GPUs of one node (NVLink)
    inter_node: Link  # between nodes (RDMA NIC per GPU)
    # The node's all-to-alls where measured apart from its all-reduces (sim/collectives.py); None: intra_node.
    intra_node_all_to_all: Link | None = None
    gpus_per_node: int = 8
    compute_efficiency: float = 0.65
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.4e-3  # launch and scheduling per step (CUDA graphs on decode)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Hardware:
        data = dict(data)
        data["intra_node"] = Link(**data["intra_node"])
        data["inter_node"] = Link(**data["inter_node"])
        if data.get("intra_node_all_to_all"):
            data["intra_node_all_to_all"] = Link(**data["intra_node_all_to_all"])
        return cls(**data)


NVLINK4 = Link("nvlink4", 450 * GB, 3e-6)
NVLINK5 = Link("nvlink5", 900 * GB, 3e-6)
LINKS = {
    "nvlink4": NVLINK4,
    "nvlink5": NVLINK5,
    "rdma-100g": Link("rdma-100g", 12.5 * GB, 8e-6),
    "rdma-200g": Link("rdma-200g", 25 * GB, 8e-6),
    "rdma-400g": Link("rdma-400g", 50 * GB, 8e-6),
}

GPUS = {
    "H100": Hardware("H100", 989e12, 1979e12, 3.35e12, 80 * GB, NVLINK4, LINKS["rdma-400g"]),
    "H200": Hardware("H200", 989e12, 1979e12, 4.8e12, 141 * GB, NVLINK4, LINKS["rdma-400g"]),
    "B200": Hardware("B200", 2250e12, 4500e12, 8.0e12, 180 * GB, NVLINK5, LINKS["rdma-400g"]),
}


def gpu(name: str, inter_node: str | None = None) -> Hardware:
    key = name.upper()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose from {', '.join(GPUS)}")
    hw = GPUS[key]
    if inter_node is not None:
        if inter_node not in LINKS:
            raise ValueError(f"unknown link {inter_node!r}; choose from {', '.join(LINKS)}")
        hw = Hardware(**{**hw.__dict__, "inter_node": LINKS[inter_node]})
    return hw
