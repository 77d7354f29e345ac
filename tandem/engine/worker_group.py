"""A worker group: one model's shards in several processes that step together (tensor and expert
parallelism, config.ParallelConfig).

Rank 0 is the engine's own process: it alone schedules and samples, as a one-process engine does.
Ranks 1..N-1 are follower processes (`python -m tandem.engine.worker_group`), each with its shard of
the weights (model/tensor_parallel.py) and its own KV pool of the same blocks (its share of the KV
heads). Before every forward pass rank 0 broadcasts the step's packed inputs (token ids, attention
metadata, the rows to sample); every rank then runs the same layers on its shard, meeting at the
collectives inside them (an all-reduce per row-parallel layer, the experts' all-to-alls). The
scheduler, the KV manager and the sampler never know the group exists: block ids mean the same
blocks in every rank's pool.

A rank that dies fails the group: the collective waiting for it raises GroupFailed, rank 0's engine
fails the requests in flight and exits, and whoever started it starts the group again (the server's
core process restarts); followers exit when rank 0 goes (its pid is watched, and the kernel kills
them with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from tandem import logs
from tandem.config import EngineConfig, ParallelConfig
from tandem.engine.group_messages import PoolSpec, StepInputs, Stop
from tandem.engine.runner import allocate_kv_pool
from tandem.kv.pool import map_shared
from tandem.model.arch import ArchConfig
from tandem.model.loader import LoadedModel, load_model
from tandem.model.tensor_parallel import Shard, head_ranges
from tandem.ops import extension
from tandem.parallel.comm import GroupAddress, GroupComm, start_rendezvous
from tandem.parallel.shm import GroupFailed
from tandem.process_exit import exit_now

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankStart:
    """What a follower is started with (pickled on its stdin)."""

    config: EngineConfig
    shard: Shard
    address: GroupAddress
    log_level: str
    cores: list[int] | None  # chosen by rank 0 before it pinned itself (a child inherits the pin)


def shard_of(parallel: ParallelConfig, rank: int) -> Shard:
    n = parallel.world_size
    return Shard(rank, n, tensor_parallel=parallel.tensor_parallel_size == n,
                 expert_parallel=parallel.expert_parallel_size == n and n > 1,
                 spare_slots=parallel.eplb_spare_slots if parallel.enable_eplb else 0,
                 eplb_interval=parallel.eplb_interval)


def kv_head_ranges(arch: ArchConfig, parallel: ParallelConfig) -> list[tuple[int, int]]:
    """Each rank's KV heads of the whole model (arch)."""
    return [head_ranges(arch, shard_of(parallel, r))[1] for r in range(parallel.world_size)]


def rank_threads(parallel: ParallelConfig) -> int:
    return max(1, parallel.num_threads // parallel.world_size)


def rank_cores(parallel: ParallelConfig, rank: int) -> list[int] | None:
    """The cores rank is pinned to: its own slice of this process's cores, when there are enough for
    every rank's threads (else none: the OS places them)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = rank_threads(parallel)
    if len(cpus) < per * parallel.world_size:
        return None
    return cpus[rank * per:(rank + 1) * per]


def _place(parallel: ParallelConfig, cores: list[int] | None) -> None:
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(rank_threads(parallel))


def _unplace(cores: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def slot_bytes(config: EngineConfig, arch: ArchConfig) -> int:
    """The shared-memory slot: a step's widest exchange (a float32 all-reduce of every row, an expert
    all-to-all of top-k rows, a rank's logits columns of the sampled rows), and the step's pickled
    inputs. Wider exchanges go through torch.distributed."""
    rows = config.scheduler.max_num_batched_tokens + config.scheduler.max_num_seqs * 8
    spec = config.speculative.num_speculative_tokens if config.speculative else 0
    logits = config.scheduler.max_num_seqs * (1 + spec) * arch.local_vocab * 4
    return min(max(rows * arch.hidden_size * 4 * max(1, arch.num_experts_per_tok), logits) + (4 << 20), 1 << 30)


class WorkerGroup:
    """Rank 0's handle on its followers: started with the model, closed with the engine."""

    def __init__(self, config: EngineConfig, model: Any, log_level: str, cores: list[list[int] | None]) -> None:
        parallel = config.parallel
        self.size = parallel.world_size
        device = torch.device(config.model.device)
        store, address = start_rendezvous(self.size, slot_bytes(config, model.cfg), device)
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, self.size):
            start = RankStart(config, shard_of(parallel, rank), address, log_level, cores[rank])
            proc = subprocess.Popen([sys.executable, "-m", "tandem.engine.worker_group"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(start))
            proc.stdin.close()
            self.procs.append(proc)
        try:
            self.comm = GroupComm(0, self.size, device, address, store)
            # Each follower says whether its shard loaded (an error message, or None).
            errors = [e for e in self.comm.gather_objects(None) if e is not None]
        except Exception:
            self.kill()
            raise
        if errors:
            self.kill()
            raise GroupFailed(f"a rank of the worker group failed to start: {errors[0]}")
        self.comm.on_close.append(self.stop)
        self.comm.liveness.append(self.check_followers)
        logs.startup.info("worker group: %d ranks (tensor parallel %d, expert parallel %d), collectives over %s",
                          self.size, parallel.tensor_parallel_size, parallel.expert_parallel_size, self.comm.backend)

    def check_followers(self) -> None:
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise GroupFailed(f"rank {rank} of the worker group (pid {p.pid}) exited with {p.returncode}")

    def stop(self) -> None:
        """Tell the followers to exit (when they can still hear it), then make sure they did."""
        try:
            if all(p.poll() is None for p in self.procs):
                self.comm.broadcast_object(Stop())
        except GroupFailed:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def load_engine_model(config: EngineConfig, log_level: str = "WARNING") -> LoadedModel:
    """The model an engine runs: the whole model in this process, or, with a worker group, rank 0's
    shard, the followers started and joined (model.comm)."""
    parallel = config.parallel
    m = config.model
    if parallel.world_size == 1:
        return load_model(m.model, m.torch_dtype, m.device, m.quantization, context=m.max_model_len)
    cores = [rank_cores(parallel, r) for r in range(parallel.world_size)]
    # Rank 0 is the caller's own process: pinned to its cores while the group lives, as it was after.
    before = os.sched_getaffinity(0), torch.get_num_threads()
    _place(parallel, cores[0])
    try:
        shard = shard_of(parallel, 0)
        loaded = load_model(m.model, m.torch_dtype, m.device, m.quantization, shard=shard, context=m.max_model_len)
        if shard.expert_parallel and not loaded.arch.num_experts:
            raise ValueError(f"expert parallelism needs a mixture-of-experts model; {loaded.name} has no experts")
        group = WorkerGroup(config, loaded.model, log_level, cores)
    except BaseException:
        _unplace(*before)
        raise
    group.comm.on_close.append(lambda: _unplace(*before))
    group.comm.use_native(extension.op("group_all_reduce"))
    loaded.model.join_group(group.comm, shard)
    loaded.model.kv_head_ranges = kv_head_ranges(loaded.arch, parallel)
    return loaded


# -- a follower ------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """The kernel kills this process when the one that started it (rank 0) dies."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_follower(start: RankStart) -> None:
    config, shard = start.config, start.shard
    logs.setup(start.log_level, process=f"rank{shard.rank}")
    _die_with_parent()
    _place(config.parallel, start.cores)
    device = torch.device(config.model.device)
    comm = GroupComm(shard.rank, shard.size, device, start.address)
    m = config.model
    extension.set_batch_invariant(m.deterministic)  # as rank 0's runner sets it: every rank's rows alike
    try:
        loaded = load_model(m.model, m.torch_dtype, m.device, m.quantization, shard=shard, context=m.max_model_len)
        error = None
    except Exception as e:  # told to rank 0, which reports it
        error = f"rank {shard.rank}: {type(e).__name__}: {e}"
    comm.gather_objects(error)
    if error is not None:
        sys.exit(1)
    model = loaded.model
    comm.use_native(extension.op("group_all_reduce"))
    model.join_group(comm, shard)
    model.kv_head_ranges = kv_head_ranges(loaded.arch, config.parallel)
    kv_caches = None
    while True:
        msg = comm.broadcast_object(None, patient=True)
        if isinstance(msg, StepInputs):
            assert kv_caches is not None
            model(msg.input_ids, msg.meta, kv_caches, msg.logits_indices)
        elif isinstance(msg, PoolSpec):
            part = msg.parts[shard.rank] if msg.parts is not None else None
            kv_caches = map_shared(part) if part is not None else \
                allocate_kv_pool(config, model.cfg, msg.num_blocks, device).local
        elif isinstance(msg, Stop):
            break
    comm.close()


def main() -> None:
    start: RankStart = pickle.loads(sys.stdin.buffer.read())
    try:
        run_follower(start)
    except GroupFailed as e:
        log.error("rank %d leaves its group: %s", start.shard.rank, e)
        sys.exit(1)
    exit_now(0)  # its group closed: skip the interpreter's teardown (process_exit.py)


if __name__ == "__main__":
    main()

