"""The worker group's collectives measured, and fitted to the link model the simulator prices them
with, so that tensor and expert parallelism at scale (RooflineCost's all-reduces, MoEDecode's
all-to-alls) rest on measured communication costs rather than a data sheet.

`tandem profile --collectives FILE` starts a group of --group-size ranks on this machine's device
(the engine's own communicator: shared memory between CPU processes here, NCCL between GPUs) and
times its all-reduce and all-to-all over a range of sizes; a link (latency, bandwidth) is fitted to
each with the simulator's own formulas (sim/hardware.py's Link):

    all-reduce of B bytes over n ranks:   2 (n - 1) latency + 2 (n - 1) / n * B / bandwidth
    all-to-all, B bytes from each rank:   latency + (1 - 1 / n) * B / bandwidth

`tandem plan --intra-link FILE` then prices a node's all-reduces (tensor parallelism) and on-node
all-to-alls (expert parallelism) with them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.sim.hardware import Link

ROWS = (1, 8, 64, 256, 1024)  # rows of hidden-size vectors, as a step's collectives carry them


@dataclass
class CollectiveFit:
    links: dict[str, Link]  # "all_reduce", "all_to_all"
    ranks: int
    backend: str
    device: str
    # (kind, bytes, seconds measured, seconds the fitted link predicts)
    points: list[tuple[str, int, float, float]] = field(default_factory=list)

    @property
    def max_error(self) -> float:
        return max(abs(p - m) / m for _, _, m, p in self.points)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "collectives", "links": {k: asdict(v) for k, v in self.links.items()}, "ranks": self.ranks,
                "backend": self.backend, "device": self.device, "points": self.points}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveFit:
        if data.get("kind") != "collectives":
            raise ValueError("not a collectives profile (`tandem profile --collectives`)")
        return cls({k: Link(**v) for k, v in data["links"].items()}, data["ranks"], data["backend"], data["device"],
                   [tuple(p) for p in data["points"]])  # type: ignore[misc]


def fit_link(points: list[tuple[str, int, float]], n: int, name: str) -> Link:
    """Latency and bandwidth, least relative error over the points (one kind or both; non-negative)."""
    from scipy.optimize import nnls

    rows, ys = [], []
    for kind, nbytes, seconds in points:
        row = [2 * (n - 1), 2 * (n - 1) / n * nbytes] if kind == "all_reduce" else [1.0, (1 - 1 / n) * nbytes]
        rows.append([v / seconds for v in row])
        ys.append(1.0)
    coef, _ = nnls(np.array(rows), np.array(ys))
    latency, inv_bw = float(coef[0]), float(coef[1])
    return Link(name, 1.0 / max(inv_bw, 1e-18), latency)


def _rank(rank: int, n: int, address: Any, hidden: int, device: str, repeats: int, queue: Any) -> None:
    import torch

    from tandem.ops import extension
    from tandem.parallel.comm import GroupComm

    if device == "cpu" and os.cpu_count() and os.cpu_count() >= n:  # type: ignore[operator]
        os.sched_setaffinity(0, [rank])  # a rank a core, as a worker group pins them
    torch.set_num_threads(1)
    comm = GroupComm(rank, n, torch.device(device), address)
    if device == "cpu":
        comm.use_native(extension.op("group_all_reduce"))
    points = []
    for rows in ROWS:
        x = torch.randn(rows, hidden, device=device)
        parts = [x[: max(rows // n, 1)]] * n
        for kind in ("all_reduce", "all_to_all"):
            def once(kind: str = kind, x: torch.Tensor = x, parts: list[torch.Tensor] = parts) -> None:
                comm.all_reduce(x) if kind == "all_reduce" else comm.all_to_all(parts)

            for _ in range(5):
                once()
            t0 = time.perf_counter()
            for _ in range(repeats):
                once()
            seconds = (time.perf_counter() - t0) / repeats
            nbytes = x.numel() * 4 if kind == "all_reduce" else sum(p.numel() for p in parts) * 4
            points.append((kind, nbytes, seconds))
    if rank == 0:
        queue.put((points, comm.backend))
    comm.close()


def measure_collectives(ranks: int = 2, device: str = "cpu", hidden: int = 4096, repeats: int = 50) -> CollectiveFit:
    """Time the group's all-reduce and all-to-all between idle ranks (child processes; this one holds
    the rendezvous)."""
    import torch

    from tandem.parallel.comm import GroupAddress, start_rendezvous

    slot = max(ROWS) * hidden * 4 + (1 << 20)
    store, address = start_rendezvous(ranks, slot, torch.device(device))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    # Every rank a child process (each pins itself to a core): the caller's own placement is untouched.
    plain = GroupAddress(address.store_port, address.shm_path, address.slot_bytes)
    peers = [ctx.Process(target=_rank, args=(r, ranks, plain, hidden, device, repeats, queue)) for r in range(ranks)]
    for p in peers:
        p.start()
    points, backend = queue.get(timeout=600)
    for p in peers:
        p.join(60)
    del store  # the rendezvous's server lived here for the ranks
    links = {kind: fit_link([p for p in points if p[0] == kind], ranks, f"measured-{backend}-{kind}")
             for kind in ("all_reduce", "all_to_all")}

    def predict(kind: str, nbytes: int) -> float:
        link = links[kind]
        if kind == "all_reduce":
            return link.all_reduce_seconds(nbytes, ranks)
        return link.all_to_all_seconds(nbytes, ranks)

    return CollectiveFit(links, ranks, backend, device, [(k, b, s, predict(k, b)) for k, b, s in points])


def save(fit: CollectiveFit, path: str | Path) -> None:
    Path(path).write_text(json.dumps(fit.to_json(), indent=1) + "\n")


def load(path: str | Path) -> CollectiveFit:
    return CollectiveFit.from_json(json.loads(Path(path).read_text()))
