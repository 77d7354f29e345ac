"""Tensor parallelism on this machine: the default model's decode step at batch 1-64 in one process
with every core's threads against a worker group of one single-threaded process per core
(--tensor-parallel-size 2), and what the group's collectives cost.

    .venv/bin/python benchmarks/tensor_parallel.py                     # batches 1,4,16,64, context 128
    .venv/bin/python benchmarks/tensor_parallel.py --batches 1,16 --rounds 2

Configurations, each engine in its own process (a group pins its ranks to cores), run in turn per
round (this machine's speed drifts; medians over rounds):
  tp1          one process, 2 threads, the native layer stack (the default)
  tp1-loop     the same with the Python layer loop (TANDEM_NATIVE_LAYERS=0): what a group runs
  tp2          two processes, one thread each, collectives over shared memory
  tp2-gloo     the same over gloo (TANDEM_GROUP_COMM=gloo)
For the groups: rank 0's seconds in all-reduces (waiting for the peer included) per step, their share
of the step, and the all-reduce's own latency between two idle ranks (--allreduce alone measures it).
Results: benchmarks/results/tensor_parallel.json, and a plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
CONFIGS = {"tp1": ({}, 1), "tp1-loop": ({"TANDEM_NATIVE_LAYERS": "0"}, 1), "tp2": ({}, 2),
           "tp2-gloo": ({"TANDEM_GROUP_COMM": "gloo"}, 2)}
# The all-reduce alone: shared memory from compiled code (the engine's), from Python, and gloo.
LATENCY = {"shm": ("shm", True), "shm-python": ("shm", False), "gloo": ("gloo", False)}


def decode_steps(tp: int, batches: list[int], context: int, steps: int, dtype: str) -> dict:
    """In this process: median decode-step seconds at each batch, and rank 0's collective seconds."""
    import numpy as np

    from tandem import LLM
    from tandem.engine.request import Request
    from tandem.engine.step import ScheduledRequest, SchedulerOutput
    from tandem.sampling_params import SamplingParams

    llm = LLM(None, dtype=dtype, tensor_parallel_size=tp, kv_cache_memory=1.0, enable_prefix_caching=False,
              max_num_seqs=max(batches))
    runner = llm.engine.core.runner
    vocab = llm.engine.loaded.arch.vocab_size
    per = -(-(context + steps + 1) // runner.block_size)
    out: dict = {"step_s": {}, "allreduce_s": {}, "collectives": {}}
    rng = np.random.default_rng(0)
    for b in batches:
        reqs = []
        for i in range(b):
            r = Request(f"r{i}", rng.integers(0, vocab, context + 1).tolist(), SamplingParams(max_tokens=steps + 2))
            reqs.append(r)
        # Context KV: one prefill step per request (its content does not matter to the timing).
        blocks = {r.request_id: list(range(i * per, (i + 1) * per)) for i, r in enumerate(reqs)}
        for r in reqs:
            runner.execute(SchedulerOutput([ScheduledRequest(r, context, blocks[r.request_id])]))
            r.num_computed_tokens = context
        times, ar = [], []
        for _ in range(steps):
            comm = runner.comm
            before = comm.all_reduce_seconds if comm else 0.0
            t0 = time.perf_counter()
            runner.execute(SchedulerOutput([ScheduledRequest(r, 1, blocks[r.request_id]) for r in reqs]))
            times.append(time.perf_counter() - t0)
            if comm:
                ar.append(comm.all_reduce_seconds - before)
            for r in reqs:
                r.all_token_ids.append(int(rng.integers(0, vocab)))
                r.num_computed_tokens += 1
        runner.forget([r.request_id for r in reqs])
        out["step_s"][b] = statistics.median(times[2:])
        if ar:
            out["allreduce_s"][b] = statistics.median(ar[2:])
    out["collectives"] = {**runner.comm.seconds, "all_reduce": runner.comm.all_reduce_seconds} if runner.comm else {}
    out["backend"] = runner.comm.backend if runner.comm else None
    llm.close()
    return out


def allreduce_latency(backend: str, sizes: list[int], dtype: str, compiled: bool) -> dict:
    """Two idle ranks (this process and one spawned), all-reducing [rows, 576] tensors back to back."""
    import multiprocessing

    import torch

    from tandem.ops import extension
    from tandem.parallel.comm import GroupComm, start_rendezvous

    if backend == "gloo":
        os.environ["TANDEM_GROUP_COMM"] = "gloo"
    store, address = start_rendezvous(2, 64 << 20, torch.device("cpu"))
    ctx = multiprocessing.get_context("spawn")
    peer = ctx.Process(target=_peer, args=(address, sizes, dtype, compiled))
    peer.start()
    os.sched_setaffinity(0, [0])  # the ranks on their own cores, as a group places them (a child process)
    torch.set_num_threads(1)
    comm = GroupComm(0, 2, torch.device("cpu"), address, store)
    if compiled:
        comm.use_native(extension.op("group_all_reduce"))
    out = {}
    for rows in sizes:
        t = torch.randn(rows, 576).to(getattr(torch, dtype))
        for _ in range(20):
            comm.all_reduce(t)
        t0 = time.perf_counter()
        for _ in range(200):
            comm.all_reduce(t)
        out[rows] = (time.perf_counter() - t0) / 200
    comm.close()
    peer.join()
    os.environ.pop("TANDEM_GROUP_COMM", None)
    return out


def _peer(address: object, sizes: list[int], dtype: str, compiled: bool) -> None:
    import torch

    from tandem.ops import extension
    from tandem.parallel.comm import GroupComm

    os.sched_setaffinity(0, [1 % os.cpu_count()])
    torch.set_num_threads(1)
    comm = GroupComm(1, 2, torch.device("cpu"), address)
    if compiled:
        comm.use_native(extension.op("group_all_reduce"))
    for rows in sizes:
        t = torch.randn(rows, 576).to(getattr(torch, dtype))
        for _ in range(220):
            comm.all_reduce(t)
    comm.close()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, res in results["configs"].items():
        batches = sorted(int(b) for b in res["step_s"])
        ax.plot(batches, [res["step_s"][str(b)] * 1e3 for b in batches], marker="o", label=name)
    tp2 = results["configs"].get("tp2")
    if tp2 and tp2["allreduce_s"]:
        batches = sorted(int(b) for b in tp2["allreduce_s"])
        ax.plot(batches, [tp2["allreduce_s"][str(b)] * 1e3 for b in batches], ls="--", label="tp2: in all-reduces")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title(f"TP 2 (two 1-thread processes) vs one 2-thread process, context {results['context']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--allreduce", action="store_true", help="only the all-reduce latency")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one configuration, JSON out
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one in LATENCY:
        backend, compiled = LATENCY[args.one]
        print(json.dumps(allreduce_latency(backend, [1, 16, 64, 1024], "float32", compiled)))
        return
    if args.one:
        print(json.dumps(decode_steps(CONFIGS[args.one][1], batches, args.context, args.steps, args.dtype)))
        return
    latency = {}
    for backend in LATENCY:
        proc = subprocess.run([sys.executable, __file__, "--one", backend], capture_output=True, text=True, check=True)
        latency[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"all-reduce of [rows, 576] float32 between idle ranks ({backend}): "
              + ", ".join(f"{r} rows {s * 1e6:.0f} us" for r, s in latency[backend].items()))
    if args.allreduce:
        return
    runs: dict[str, list[dict]] = {}
    names = args.configs.split(",")
    for rnd in range(args.rounds):
        for name in names:
            env = {**os.environ, **CONFIGS[name][0]}
            cmd = [sys.executable, __file__, "--one", name, "--batches", args.batches, "--context", str(args.context),
                   "--steps", str(args.steps), "--dtype", args.dtype]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.setdefault(name, []).append(res)
            print(f"round {rnd + 1} {name}: " + ", ".join(f"b{b} {s * 1e3:.1f} ms" for b, s in res["step_s"].items()),
                  flush=True)
    configs = {}
    for name, rs in runs.items():
        configs[name] = {key: {b: statistics.median(r[key][b] for r in rs) for b in rs[0][key]}
                         for key in ("step_s", "allreduce_s")}
        configs[name]["backend"] = rs[0]["backend"]
    results = {"context": args.context, "batches": batches, "dtype": args.dtype, "configs": configs,
               "allreduce_latency_s": latency, "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    print("\nbatch  " + "  ".join(f"{n:>10}" for n in configs) + "   tp2/tp1  tp2 all-reduce share")
    for b in batches:
        row = [configs[n]["step_s"].get(str(b), float("nan")) * 1e3 for n in configs]
        tp1, tp2 = configs.get("tp1", {}).get("step_s", {}).get(str(b)), configs.get("tp2", {}).get("step_s", {})
        ratio = tp2.get(str(b)) / tp1 if tp1 and tp2.get(str(b)) else float("nan")
        share = configs.get("tp2", {}).get("allreduce_s", {}).get(str(b), float("nan")) / tp2.get(str(b), float("nan"))
        print(f"{b:5d}  " + "  ".join(f"{v:8.1f}ms" for v in row) + f"   {ratio:7.2f}  {share:8.0%}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1))
    plot(json.loads(json.dumps(results)), args.results.with_suffix(".png"))
    print(f"wrote {args.results} and {args.results.with_suffix('.png')}")


if __name__ == "__main__":
    main()
