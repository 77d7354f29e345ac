"""The engine core in its own process, stepping continuously, talking ZeroMQ.

HTTP parsing, tokenization and detokenization happen in the API server's process; this one only
schedules and runs the model, so a burst of HTTP work never delays a step. Messages are pickled
Python objects over local IPC sockets (both ends are this project's own processes).

  frontend -> core (PUSH/PULL): ("add", [Request]), ("abort", [request_id]), ("shutdown", None)
  core -> frontend (PUSH/PULL): ("ready", info), ("outputs", [EngineCoreOutput], CoreStats),
                                ("failed", [request_id], message)
  core -> anyone (PUB, optional): ("kv_events", seq, [BlockStored | BlockRemoved]) after each step
                                  that changed the prefix cache, for a KV-aware router
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from tandem.config import EngineConfig

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle core waits for input before sending a heartbeat


@dataclass
class CoreStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    time: float
    # Cumulative time of steps that computed prompt tokens, and those tokens: the rate at which
    # queued prompts drain, decodes sharing the steps included (admission control divides them).
    prompt_busy_s: float = 0.0
    num_computed_prompt_tokens: int = 0
    kv_store: dict = field(default_factory=dict)  # tier name -> TierStats (kv/store/tier.py)


@dataclass
class CoreInfo:
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    num_blocks: int
    model_name: str
    max_num_seqs: int = 1
    # How this engine keys its blocks (kv/hashing.py), so a router can match them: the extra key
    # (model fingerprint, block size), the block size, the hash and a block's bytes in a store.
    block_key_extra: tuple = ()
    block_size: int = 16
    hash_algo: str = "sha256"
    block_nbytes: int = 0


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str = "WARNING",
                    kv_events_endpoint: str | None = None) -> None:
    """Process entry point."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s core: %(message)s")
    # The parent handles SIGINT/SIGTERM and tells us to shut down; don't die half-way through a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    kv_pub = None
    if kv_events_endpoint:
        config.cache.enable_kv_events = True
        kv_pub = ctx.socket(zmq.PUB)
        kv_pub.bind(kv_events_endpoint)
    try:
        from tandem.engine.core import EngineCore
        from tandem.model.loader import load_model

        loaded = load_model(config.model.model, config.model.dtype, config.model.device)
        core = EngineCore(config, loaded.model)
        out.send_pyobj(("ready", core_info(core, loaded)))
    except Exception as e:  # report why we could not start, then exit non-zero
        out.send_pyobj(("startup_failed", f"{type(e).__name__}: {e}"))
        out.close(linger=2000)
        os._exit(1)
    try:
        _loop(core, inp, out, kv_pub)
    finally:
        core.close()
    out.close(linger=1000)
    if kv_pub is not None:
        kv_pub.close(linger=0)
    inp.close(linger=0)
    ctx.term()


def core_info(core, loaded) -> CoreInfo:  # noqa: ANN001 (EngineCore, LoadedModel)
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    cache = core.config.cache
    return CoreInfo(core.max_model_len, loaded.arch.vocab_size, eos if eos is not None else loaded.arch.eos_token_id,
                    core.num_blocks, loaded.name, core.config.scheduler.max_num_seqs, core.block_key_extra,
                    cache.block_size, cache.prefix_caching_hash_algo,
                    loaded.arch.kv_bytes_per_token(core.config.model.dtype.itemsize) * cache.block_size)


def core_stats(core) -> CoreStats:  # noqa: ANN001 (EngineCore)
    s = core.stats()
    usage = core.scheduler.kv.usage()
    return CoreStats(s.num_running, s.num_waiting, s.kv_usage, usage.num_used_blocks, usage.num_blocks,
                     s.num_preemptions, s.prefix_queries, s.prefix_hits, core.num_prompt_tokens,
                     core.num_generation_tokens, time.monotonic(), core.prompt_busy_s, core.num_computed_prompt_tokens,
                     core.connector.stats().get("tiers", {}))


def send_failures(outputs: list, send: Callable[[list[str], str], None]) -> list:
    """Report the requests a step failed (each fails alone: a 500 for it, nobody else) and return the
    other outputs."""
    for o in outputs:
        if o.error is not None:
            send([o.request_id], o.error)
    return [o for o in outputs if o.error is None]


def _loop(core, inp: zmq.Socket, out: zmq.Socket, kv_pub: zmq.Socket | None) -> None:  # noqa: ANN001
    seq = 0
    last_stats = 0.0
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        # Block only when idle; while busy, take whatever arrived and step again.
        timeout = 0 if core.has_unfinished() else IDLE_POLL_MS
        events = dict(poller.poll(timeout))
        while events.get(inp):
            kind, payload = inp.recv_pyobj()
            if kind == "shutdown":
                core.abort(list(core.scheduler.requests))
                return
            if kind == "add":
                for request in payload:
                    core.add_request(request)
            elif kind == "abort":
                core.abort(payload)
            events = dict(poller.poll(0))
        if not core.has_unfinished():
            out.send_pyobj(("outputs", [], core_stats(core)))  # heartbeat with fresh stats
            continue
        try:
            outputs = core.step()
        except Exception as e:
            # A failed step fails the requests in it, not the server: free them and carry on.
            log.error("engine step failed: %s", traceback.format_exc())
            failed = list(core.scheduler.requests)
            core.abort(failed)
            out.send_pyobj(("failed", failed, f"engine error: {type(e).__name__}: {e}"))
            continue
        outputs = send_failures(outputs, lambda ids, message: out.send_pyobj(("failed", ids, message)))
        now = time.monotonic()
        # An empty step (waiting for KV to load) reports no more often than an idle heartbeat.
        if outputs or now - last_stats >= IDLE_POLL_MS / 1000:
            out.send_pyobj(("outputs", outputs, core_stats(core)))
            last_stats = now
        if kv_pub is not None:
            changes = core.scheduler.kv.pool.take_events()
            if changes:  # PUB drops when nobody listens: publishing never blocks a step
                kv_pub.send_pyobj(("kv_events", seq, changes))
                seq += 1
