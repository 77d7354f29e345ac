"""`tandem worker`: a prefill, decode or colocated worker that joins a router."""

from __future__ import annotations

import argparse
import os
import socket

from tandem.cli.common import add_log_args
from tandem.engine.args import add_engine_args, engine_kwargs


def cmd_worker(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig
    from tandem.disagg.fleet.local_launcher import parse_cores
    from tandem.disagg.worker.cluster_worker import run_worker
    from tandem.disagg.worker.wire import secret_from_env

    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    cores = parse_cores(args.cores) if args.cores else None
    return run_worker(config, args.role, args.router, secret_from_env(), worker_id, cores, args.kv_transport,
                      args.kv_host, args.parent_pid, args.profile_speed, threads_follow_cores=args.num_threads is None)


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    wrk = sub.add_parser("worker", help="a prefill or decode worker that joins a router (tandem serve)")
    add_engine_args(wrk)
    wrk.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    wrk.add_argument("--router", required=True, help="the router's worker address, e.g. tcp://10.0.0.1:5600")
    wrk.add_argument("--worker-id", default=None)
    wrk.add_argument("--cores", default=None, help="pin to these cores (e.g. 0 or 0-3); threads follow")
    wrk.add_argument("--kv-transport", default="zmq", choices=["shm", "zmq", "none"],
                     help="decode and colocated workers: receive KV by shared memory (same host only) or "
                          "ZeroMQ/TCP; none: no receiver (a lone worker, whom no other sends KV)")
    wrk.add_argument("--kv-host", default="127.0.0.1", help="decode workers: address the KV receiver binds")
    wrk.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # exit when it exits
    wrk.add_argument("--profile-speed", action="store_true",
                     help="time this engine's steps at start (a second or more; kept per machine and settings), "
                          "so that the router's admission predicts a lone worker from them")
    add_log_args(wrk)
    wrk.set_defaults(func=cmd_worker)
