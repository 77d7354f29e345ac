"""`tandem serve`: the OpenAI-compatible server over a router and its workers (one colocated worker on
every core when no workers are asked for: the single server is a cluster of one)."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from tandem.cli.cluster import disaggregated_engine
from tandem.cli.serve_args import add_serve_parser
from tandem.config import EngineConfig
from tandem.engine.args import engine_kwargs
from tandem.policy.admission import AdmissionSettings


def parse_weights(items: list[str]) -> dict[str, float]:
    weights = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--tenant-weight takes NAME=WEIGHT, got {item!r}")
        weights[name] = float(value)
        if not weights[name] > 0:
            raise ValueError(f"--tenant-weight {item!r}: the weight must be positive")
    return weights


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.serve.startup import bind_port

    with bind_port(args.host, args.port) as http_socket:  # before a minute of loading, not after
        return _serve(args, http_socket)


def _serve(args: argparse.Namespace, http_socket: socket.socket) -> int:
    import signal
    from pathlib import Path

    from tandem.logs import startup
    from tandem.serve.startup import check_memory
    from tandem.slo import Slo

    # The KV pools this host will hold: its local workers', or the one core's (a bare router holds none).
    pools = 0 if args.ray else (args.prefill_workers + args.decode_workers + args.workers or int(not args.router_bind))
    if args.num_blocks is None and pools:
        check_memory(args.kv_cache_memory, pools)
    owned_shm = None
    if args.kv_offload_memory > 0 and args.kv_offload_path is None:
        from tandem.kv.store.host_tier import default_shm_path

        # One host tier per deployment, shared by its engine processes and removed when it stops.
        args.kv_offload_path = owned_shm = default_shm_path(f"serve-{os.getpid()}")
    admission = AdmissionSettings(args.admission, args.max_waiting_requests, args.max_queue_delay,
                                  args.seat_overcommit, args.admission_ttft_budget or None,
                                  args.max_tenant_waiting_requests, args.max_tenant_queued_tokens)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    lone = not (args.prefill_workers or args.decode_workers or args.workers or args.router_bind)
    if lone:  # one engine: a cluster of one colocated worker on every core this process may use
        args.workers = 1
        args.worker_cores = args.worker_cores or [",".join(map(str, sorted(os.sched_getaffinity(0))))]
        args.kv_transport = "none"  # no other worker to send it KV: its pool stays private memory, not shm
    startup.info("admission: %s", admission.describe(slo, router=not lone))
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    # The engine processes start before this process imports the app and loads the tokenizer, so their
    # start (torch, the model, the KV pool) overlaps that.
    engine = disaggregated_engine(args, config, None)
    startup.info("starting a router (%d prefill, %d decode, %d colocated local workers)", args.prefill_workers,
                 args.decode_workers, args.workers)
    engine.launch()

    import uvicorn

    from tandem.model_path import DEFAULT_MODEL_NAME
    from tandem.serve.api import ServerSettings, build_app
    from tandem.serve.startup import AnnouncingServer
    from tandem.tokenizer import load_tokenizer

    keys = list(args.api_key or [])
    if not keys and os.environ.get("TANDEM_API_KEY"):
        keys = [os.environ["TANDEM_API_KEY"]]
    settings = ServerSettings(args.served_model_name, keys, args.request_timeout,
                              args.log_level.upper(),
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_prompt_chars=args.max_prompt_chars,
                              trust_request_chat_template=args.trust_request_chat_template,
                              reject_unknown_fields=args.reject_unknown_fields,
                              admission=admission, tenant_header=args.tenant_header,
                              tenant_weights=parse_weights(args.tenant_weight or []),
                              metrics_require_api_key=args.metrics_require_api_key,
                              slo=slo, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                              max_stored_responses=args.max_stored_responses,
                              structured_outputs_whitespace=args.structured_outputs_whitespace)
    tokenizer = load_tokenizer(args.model)
    engine.attach_tokenizer(tokenizer)
    app = build_app(config, settings, tokenizer, engine)
    if "torch" in sys.modules:
        # This process parses HTTP and tokenizes (without torch where it serves one colocated core); the
        # model's threads belong to the engine processes.
        sys.modules["torch"].set_num_threads(1)
    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal with the handler that
    # was installed before it; make that one a clean exit, as a supervisor expects.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    model = args.served_model_name or (Path(args.model).stem if args.model else DEFAULT_MODEL_NAME)
    server = AnnouncingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                             timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                                             log_config=None), model, bool(keys))
    try:
        server.run(sockets=[http_socket])
    finally:
        if owned_shm is not None and os.path.exists(owned_shm):
            os.unlink(owned_shm)
    return 0


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    add_serve_parser(sub).set_defaults(func=cmd_serve)
