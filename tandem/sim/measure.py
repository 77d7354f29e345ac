"""`tandem profile` on this machine: drive the live engine core through prefills of many lengths and
decode batches of many sizes and contexts, log every step it runs (shape and seconds), fit the step
cost model to them, and time the KV transports and a message hop with the real sockets."""

from __future__ import annotations

import os
import pickle
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

from tandem.config import EngineConfig
from tandem.cpu_info import cpu_model_name
from tandem.engine.core import EngineCore
from tandem.engine.kv_layout import engine_kv_layout
from tandem.engine.step_meter import LoggedStep
from tandem.kv.pool import KVPool
from tandem.sim.colocation_profile import Scenario, measure_neighbours
from tandem.sim.cost import DEFAULT_KNOTS, FittedCost, StepShape, TransferFit, fit_steps
from tandem.sim.drive import run_prompts


@dataclass(frozen=True)
class ProfileGrid:
    prefill_lens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 12
    repeats: int = 2  # each scenario run this many times: a shared machine's steps vary run to run
    max_batch_tokens: int = 32768  # a decode batch's prompts, all told (their prefill is the slow part)
    transfer_blocks: tuple[int, ...] = (1, 4, 16, 64)
    serve_batches: tuple[int, ...] = (1, 4, 16)  # the serving calibration's decode batches
    serve_prompts: tuple[int, ...] = (32, 256, 768)  # and its prompt lengths
    neighbour_repeats: int = 3  # scenarios per median of the co-location term
    neighbour_scenario: Scenario = Scenario()

    @classmethod
    def quick(cls) -> ProfileGrid:
        return cls((16, 256), (1, 4), (64,), 4, 1, transfer_blocks=(1, 8), serve_batches=(1, 4),
                   serve_prompts=(32,), neighbour_repeats=1,
                   neighbour_scenario=Scenario(prefill_tokens=128, decode_batch=4, decode_context=64, decode_steps=8))


def shape_of(step: LoggedStep) -> StepShape:
    return StepShape.of((n, computed, sampled) for _, n, computed, sampled in step.scheduled)


def measure_steps(core: EngineCore, grid: ProfileGrid, vocab: int, progress: Callable[[str], None],
                  seed: int = 0) -> list[LoggedStep]:
    rng = np.random.default_rng(seed)
    capacity = core.num_blocks * core.config.cache.block_size
    limit = min(core.max_model_len, capacity)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(1, vocab, length).tolist() for _ in range(n)]

    run_prompts(core, prompts(2, 64), 4, "warmup")
    steps: list[LoggedStep] = []
    for length in grid.prefill_lens:
        if length + 1 > limit:
            continue
        progress(f"prefill of {length} tokens")
        for rep in range(grid.repeats):
            steps += run_prompts(core, prompts(1, length), 1, f"p{length}-{rep}")
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            if batch * (context + grid.decode_steps) > min(capacity, grid.max_batch_tokens) \
                    or context + grid.decode_steps > limit:
                continue
            progress(f"decode: {batch} streams at {context} tokens of context")
            for rep in range(grid.repeats):
                steps += run_prompts(core, prompts(batch, context), grid.decode_steps, f"d{batch}x{context}-{rep}")
    return steps


def measure_transfer(kind: str, core: EngineCore, num_blocks: tuple[int, ...], repeats: int = 3) -> TransferFit:
    """Time the real transport: a decode-side receiver and pool, a sender writing every layer's
    slice of n blocks, then waiting for the fence."""
    from tandem.disagg.worker.transport import TransferHandle
    from tandem.disagg.worker.transports.factory import RoutingSender, make_receiver

    secret = os.urandom(32)
    arch = core.runner.model.cfg
    pool_blocks = max(num_blocks)
    shape = (arch.num_layers, 2, pool_blocks, core.config.cache.block_size, arch.num_kv_heads,
             core.runner.kv_caches.shape[-1])
    receiver = make_receiver(kind, "127.0.0.1", 0, secret)
    dtype = core.runner.kv_caches.dtype
    receiver.attach(KVPool.in_shared_memory(shape, dtype) if receiver.needs_shared_pool
                    else KVPool.whole(torch.zeros(shape, dtype=dtype)))
    sender = RoutingSender(secret)
    src = torch.ones(shape, dtype=core.runner.kv_caches.dtype)
    sizes, seconds = [], []
    try:
        for n in num_blocks:
            ids = list(range(n))
            best = float("inf")
            for rep in range(repeats + 1):
                rid = f"xfer-{n}-{rep}"
                receiver.open(rid, ids)
                handle = TransferHandle(rid, ids, 0, receiver.endpoint)
                t0 = time.perf_counter()
                for layer in range(arch.num_layers):
                    sender.write(handle, layer, ids, src[layer][:, :n])
                sender.finish(handle)
                results = []
                while not results:
                    results = sender.poll()
                    if not results:
                        time.sleep(0.0002)
                elapsed = time.perf_counter() - t0
                receiver.close(rid)
                if not results[0].ok:
                    raise RuntimeError(f"{kind} transfer failed: {results[0].error}")
                if rep:  # the first opens the connection
                    best = min(best, elapsed)
            sizes.append(n * src[0].numel() // pool_blocks * src.element_size() * arch.num_layers)
            seconds.append(best)
    finally:
        sender.close()
        receiver.shutdown()
    a = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1)
    lat, per_byte = np.linalg.lstsq(a, np.asarray(seconds), rcond=None)[0]
    per_byte = max(per_byte, 1e-15)
    return TransferFit(max(float(lat), 0.0), 1.0 / float(per_byte))


def measure_hop(rounds: int = 200) -> float:
    """Half a round trip of a small pickled message between a ROUTER and a DEALER over loopback TCP."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, msg = router.recv_multipart()
                router.send_multipart([ident, msg])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    payload = pickle.dumps({"request_id": "x" * 16, "tokens": list(range(8))})
    times = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            dealer.send(payload)
            pickle.loads(dealer.recv())
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
        dealer.close(0)
        router.close(0)
    return statistics.median(times) / 2


def profile(config: EngineConfig, grid: ProfileGrid | None = None, progress: Callable[[str], None] = print,
            transports: tuple[str, ...] = ("shm", "zmq"), serve_argv: list[str] | None = None,
            log_dir: Path = Path("."), neighbour_argv: list[str] | None = None) -> tuple[FittedCost, list[LoggedStep]]:
    """The fitted cost model of this engine on this machine, and the steps it was fitted to; with
    serve_argv, the serving path's share of a step too (calibrate.py: `tandem serve` with those flags);
    with neighbour_argv (the engine's flags), how its steps slow beside another engine on the host's
    other cores (colocation_profile.py)."""
    from tandem.engine.worker_group import load_engine_model

    grid = grid or ProfileGrid()
    progress("loading the model")
    loaded = load_engine_model(config)
    core = EngineCore(config, loaded.model)
    try:
        steps = measure_steps(core, grid, loaded.arch.vocab_size, progress)
        progress(f"fitting the step cost to {len(steps)} steps")
        shapes = [shape_of(s) for s in steps]
        seconds = [s.seconds for s in steps]
        coefficients = fit_steps(shapes, seconds, DEFAULT_KNOTS)
        fits = {}
        for kind in transports:
            progress(f"timing the {kind} KV transport")
            fits[kind] = measure_transfer(kind, core, grid.transfer_blocks)
        progress("timing a message hop")
        hop = measure_hop()
        neighbours = None
        if neighbour_argv is not None:
            neighbours = measure_neighbours(core, neighbour_argv, loaded.arch.vocab_size, progress,
                                            repeats=grid.neighbour_repeats, scenario=grid.neighbour_scenario)
        layout = engine_kv_layout(config, loaded.arch)
        cost = FittedCost(coefficients, list(DEFAULT_KNOTS), float(layout.bytes_per_token(loaded.arch)),
                          loaded.arch.num_layers, core.num_blocks * config.cache.block_size, fits,
                          "shm" if "shm" in fits else next(iter(fits), "shm"), hop,
                          meta={"model": config.model.model or "default", "dtype": str(config.model.torch_dtype),
                                "quantization": config.model.quantization, "num_threads": config.parallel.num_threads,
                                "cpu": cpu_model_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "fit_error": fit_error(coefficients, shapes, seconds),
                                # What the fit saw: (tokens, sequences, sampled, prefill pairs, decode
                                # context, decodes, seconds) per step, to plot it against the fit.
                                "steps": [[*astuple(sh), t] for sh, t in zip(shapes, seconds, strict=True)]},
                          engine={"max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                                  "max_num_seqs": config.scheduler.max_num_seqs,
                                  "long_prefill_token_threshold": config.scheduler.long_prefill_token_threshold,
                                  "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
                                  "block_size": config.cache.block_size,
                                  "enable_prefix_caching": config.cache.enable_prefix_caching,
                                  "max_model_len": core.max_model_len},
                          neighbours=neighbours)
    finally:
        core.close()
    del core, loaded
    if serve_argv is not None:
        from tandem.sim.calibrate import calibrate, fit_serving
        from tandem.tokenizer import load_tokenizer

        points = calibrate(cost, serve_argv, load_tokenizer(config.model.model), log_dir / "profile-serve.log",
                           progress, grid.serve_batches, grid.serve_prompts)
        cost.serving = fit_serving(points)
        cost.meta["serving_points"] = points
    return cost, steps


def fit_error(coefficients: list[float], shapes: list[StepShape], seconds: list[float]) -> dict[str, float]:
    """How far the fit is from the steps; and, for scale, how far steps of one shape are from their
    own median (the machine's noise: no fit gets closer than that)."""
    cost = FittedCost(coefficients, list(DEFAULT_KNOTS), 0.0, 1, 0)
    rel = [abs(cost.step_time(s) - t) / t for s, t in zip(shapes, seconds, strict=True) if t > 0]
    groups: dict[tuple, list[float]] = {}
    for s, t in zip(shapes, seconds, strict=True):
        key = (s.num_tokens, s.num_seqs, s.num_decode, round(s.decode_context / max(s.num_decode, 1), -2),
               round(s.prefill_pairs, -3))
        groups.setdefault(key, []).append(t)
    spread = [abs(t - float(np.median(ts))) / float(np.median(ts)) for ts in groups.values() if len(ts) > 1
              for t in ts]
    return {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)), "max": float(np.max(rel)),
            "repeat_spread_median": float(np.median(spread)) if spread else 0.0,
            "repeat_spread_p90": float(np.percentile(spread, 90)) if spread else 0.0}


