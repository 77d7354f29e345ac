"""`tandem generate | serve | bench ...`"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time

from tandem import logs
from tandem.engine.args import add_engine_args, engine_argv, engine_kwargs
from tandem.logs import LOG_FORMATS
from tandem.serve.admission import AdmissionSettings
from tandem.serve.tool_calls.formats import FORMATS


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


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    prompts: list[str] = list(args.prompt or [])
    if args.input:
        with open(args.input) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    prompts.append(row["prompt"] if isinstance(row, dict) else row)
    if not prompts:
        print("error: give --prompt TEXT or --input FILE.jsonl", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.outputs[0].text,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(f"--- {prompt!r}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}]")
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f}s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    import torch
    import uvicorn

    from tandem.config import EngineConfig
    from tandem.logs import startup
    from tandem.model.loader import DEFAULT_MODEL_NAME, load_tokenizer
    from tandem.serve.api import ServerSettings, build_app
    from tandem.serve.startup import AnnouncingServer, check_memory, check_port
    from tandem.slo import Slo

    check_port(args.host, args.port)  # before a minute of loading, not after
    # The KV pools this host will hold: its local workers', or the one core's (a bare router holds none).
    pools = 0 if args.ray else (args.prefill_workers + args.decode_workers + args.workers or int(not args.router_bind))
    if args.num_blocks is None and pools:
        check_memory(args.kv_cache_memory, pools)
    # This process parses HTTP and tokenizes; the model's threads belong to the core process.
    torch.set_num_threads(1)
    keys = list(args.api_key or [])
    if not keys and os.environ.get("TANDEM_API_KEY"):
        keys = [os.environ["TANDEM_API_KEY"]]
    owned_shm = None
    if args.kv_offload_memory > 0 and args.kv_offload_path is None:
        from tandem.kv.store.host_tier import default_shm_path

        # One host tier per deployment, shared by its engine processes and removed when it stops.
        args.kv_offload_path = owned_shm = default_shm_path(f"serve-{os.getpid()}")
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    admission = AdmissionSettings(args.max_waiting_requests, args.seat_overcommit, args.admission_ttft_budget or None,
                                  args.max_tenant_waiting_requests, args.max_tenant_queued_tokens)
    settings = ServerSettings(args.served_model_name, keys, args.request_timeout,
                              args.log_level.upper(), args.kv_events_endpoint,
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_prompt_chars=args.max_prompt_chars,
                              trust_request_chat_template=args.trust_request_chat_template,
                              admission=admission, tenant_header=args.tenant_header,
                              tenant_weights=parse_weights(args.tenant_weight or []),
                              metrics_require_api_key=args.metrics_require_api_key,
                              slo=Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000),
                              tool_call_parser=args.tool_call_parser)
    tokenizer = load_tokenizer(args.model)
    engine = None
    if args.prefill_workers or args.decode_workers or args.workers or args.router_bind:
        engine = _disaggregated_engine(args, config, tokenizer)
        startup.info("starting a router (%d prefill, %d decode, %d colocated local workers)", args.prefill_workers,
                     args.decode_workers, args.workers)
    else:
        startup.info("starting the engine core process")
    app = build_app(config, settings, tokenizer, engine)
    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal with the handler that
    # was installed before it; make that one a clean exit, as a supervisor expects.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    model = args.served_model_name or (Path(args.model).stem if args.model else DEFAULT_MODEL_NAME)
    server = AnnouncingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                             timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                                             log_config=None), model, bool(keys))
    try:
        server.run()
    finally:
        if owned_shm is not None and os.path.exists(owned_shm):
            os.unlink(owned_shm)
    return 0


def _disaggregated_engine(args: argparse.Namespace, config, tokenizer):  # noqa: ANN001, ANN202
    from tandem.disagg.launch import local_launcher
    from tandem.disagg.planner import PlannerSettings
    from tandem.disagg.router import DisaggEngine
    from tandem.disagg.routing import RoutingSettings
    from tandem.disagg.settings import RouterSettings
    from tandem.disagg.wire import SECRET_ENV, new_secret
    from tandem.slo import Slo

    secret = os.environ.get(SECRET_ENV, "").encode() or new_secret().hex().encode()
    launch = None
    num_local = args.prefill_workers + args.decode_workers + args.workers
    role_argv = {"prefill": shlex.split(args.prefill_worker_args), "decode": shlex.split(args.decode_worker_args)}
    bind = args.router_bind or "tcp://127.0.0.1:0"
    if args.ray:
        from tandem.disagg.ray_launch import connect, ray_launcher

        if not num_local:
            raise ValueError("--ray places workers: give --prefill-workers/--decode-workers or --workers")
        # Workers on other hosts connect back to this node's address (as the cluster knows it), unless
        # --router-bind says where; a loopback router keeps the workers' KV on loopback too.
        node = connect(args.ray)
        bind = args.router_bind or f"tcp://{node}:0"
        loopback = bind.startswith(("tcp://127.", "tcp://localhost"))
        launch = ray_launcher(args.prefill_workers, args.decode_workers, args.workers, args.ray_worker_cpus,
                              engine_argv(args), role_argv, secret, args.log_level.upper(),
                              "127.0.0.1" if loopback else None)
    elif num_local:
        launch = local_launcher(args.prefill_workers, args.decode_workers, args.worker_cores, engine_argv(args),
                                role_argv, args.kv_transport, secret, args.log_level.upper(), args.workers)
    routing = RoutingSettings(args.routing_policy, args.routing_overlap_weight, args.routing_temperature,
                              args.routing_guard_ratio, paths=args.path_policy,
                              slo=Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))
    planner = PlannerSettings(args.planner == "on", args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                              args.planner_interval, window_s=args.planner_window, dwell_s=args.planner_dwell)
    settings = RouterSettings(bind=bind, secret=secret,
                              expected_workers=num_local, heartbeat_timeout=args.worker_heartbeat_timeout)
    return DisaggEngine(config, tokenizer, settings, launch=launch, routing=routing, planner=planner)


def cmd_worker(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig
    from tandem.disagg.launch import parse_cores
    from tandem.disagg.wire import secret_from_env
    from tandem.disagg.worker import run_worker

    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    cores = parse_cores(args.cores) if args.cores else None
    return run_worker(config, args.role, args.router, secret_from_env(), worker_id, cores, args.kv_transport,
                      args.kv_host, args.parent_pid)


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                   help="text for people (default), or json: one object a line with ts, level, process, msg "
                        "and the event's fields; the deployment's child processes log the same way")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference server")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation over prompts or a JSONL file")
    add_engine_args(gen)
    gen.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL file: one {\"prompt\": ...} per line")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--api-key", action="append", help="required bearer token on /v1/* (repeatable; "
                     "or TANDEM_API_KEY); each key is its own prefix-cache tenant")
    adm = srv.add_argument_group("admission and fairness (429 with Retry-After for what cannot be served in time)")
    adm.add_argument("--max-waiting-requests", type=int, default=512,
                     help="requests queued without a first token before new ones get 429")
    adm.add_argument("--seat-overcommit", type=float, default=AdmissionSettings.seat_overcommit,
                     help="requests in flight per engine sequence slot (max-num-seqs); above 1 some wait for one, "
                     "1 keeps TPOT under overload")
    adm.add_argument("--admission-ttft-budget", type=float, default=0.0, metavar="SECONDS",
                     help="refuse a request whose queued prompt work ahead would delay its first token longer "
                     "(at the measured prompt rate): the TTFT SLO to keep under overload; 0: no limit")
    adm.add_argument("--max-tenant-waiting-requests", type=int, default=None,
                     help="requests one tenant may have waiting for a first token")
    adm.add_argument("--max-tenant-queued-tokens", type=int, default=None,
                     help="prompt tokens one tenant may have waiting")
    adm.add_argument("--tenant-header", default=None,
                     help="name tenants by this request header (e.g. X-Tenant) instead of by API key")
    adm.add_argument("--tenant-weight", action="append", metavar="NAME=WEIGHT",
                     help="a tenant's share of prompt compute against others (NAME: an API key or header value)")
    srv.add_argument("--metrics-require-api-key", action="store_true",
                     help="put /metrics behind the API key too")
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    srv.add_argument("--graceful-shutdown-timeout", type=int, default=30)
    srv.add_argument("--uvicorn-log-level", default="warning")
    add_log_args(srv)
    srv.add_argument("--kv-events-endpoint", default=None,
                     help="publish prefix-cache block events on this ZeroMQ PUB address (e.g. tcp://127.0.0.1:5557)")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                     help="larger request bodies get 413 (checked before they are read)")
    srv.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                     help="characters of text (all prompts or messages) per request, checked before tokenizing")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a chat_template in chat requests (rendered in a sandbox process with a time "
                     "and a size budget); refused with 400 by default")
    srv.add_argument("--tool-call-parser", default="auto", choices=["auto", *FORMATS],
                     help="how the model writes tool calls; auto: from its chat template (Hermes's <tool_call> "
                     "tags when the template knows no tools, which Tandem then describes in the system prompt)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice auto is always on")
    dis = srv.add_argument_group("disaggregation (a router in front of prefill and decode workers)")
    dis.add_argument("--prefill-workers", type=int, default=0, help="prefill workers to start on this host")
    dis.add_argument("--decode-workers", type=int, default=0, help="decode workers to start on this host")
    dis.add_argument("--workers", type=int, default=0,
                     help="colocated (full) workers to start on this host: data parallel behind the router, "
                     "alone or next to prefill/decode workers")
    dis.add_argument("--worker-cores", nargs="+", default=None, metavar="CORES",
                     help="cores of each local worker, prefill workers first, then decode, then colocated "
                     "(e.g. 0 1, or 0-1 2-3); default one core each, round-robin")
    dis.add_argument("--prefill-worker-args", default="", metavar="FLAGS",
                     help="engine flags for prefill workers only, e.g. \"--max-num-batched-tokens 4096\"")
    dis.add_argument("--decode-worker-args", default="", metavar="FLAGS",
                     help="engine flags for decode workers only, e.g. \"--max-num-seqs 256\"")
    dis.add_argument("--kv-transport", default="shm", choices=["shm", "zmq"],
                     help="how local decode workers receive KV: shared memory or ZeroMQ/TCP")
    dis.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="place the workers as Ray actors on the cluster at ADDRESS (default: the one this host "
                     "belongs to), a placement group each; needs the ray extra")
    dis.add_argument("--ray-worker-cpus", type=int, default=1, help="CPUs Ray reserves for each worker")
    dis.add_argument("--router-bind", default=None,
                     help="address workers connect to (e.g. tcp://0.0.0.0:5600 to let other hosts join; "
                     "they need the same $TANDEM_DISAGG_SECRET)")
    dis.add_argument("--worker-heartbeat-timeout", type=float, default=5.0,
                     help="seconds of silence before a worker is declared dead")
    rt = srv.add_argument_group("routing (which worker a request goes to)")
    rt.add_argument("--routing-policy", default="kv", choices=["kv", "least-loaded", "round-robin"],
                    help="kv: the worker where the prompt's prefix is cached, weighed against its load")
    rt.add_argument("--routing-overlap-weight", type=float, default=1.0,
                    help="kv: what one block still to prefill costs, in blocks of decode load")
    rt.add_argument("--routing-temperature", type=float, default=0.0, help="kv: > 0 draws from a softmax of the costs")
    rt.add_argument("--routing-guard-ratio", type=float, default=1.5,
                    help="kv: a worker serving more than this times the mean requests (+1) gets no more")
    rt.add_argument("--path-policy", default="slo", choices=["slo", "disaggregated"],
                    help="slo: per request, the path (colocated on one worker, disaggregated over a prefill/decode "
                    "pair, prefill-free from the KV store) whose predicted TTFT and TPOT meet --slo-ttft-ms and "
                    "--slo-tpot-ms with the most headroom; disaggregated: every prompt through a pair when "
                    "there is one")
    pl = srv.add_argument_group("SLOs and the planner (which moves local workers between prefill and decode)")
    pl.add_argument("--planner", default="off", choices=["on", "off"])
    pl.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the SLO on time to first token (p90)")
    pl.add_argument("--slo-tpot-ms", type=float, default=200.0, help="the SLO on time per output token (p90)")
    pl.add_argument("--planner-interval", type=float, default=5.0, help="seconds between the planner's decisions")
    pl.add_argument("--planner-dwell", type=float, default=120.0, help="seconds after an action before the next")
    pl.add_argument("--planner-window", type=float, default=60.0,
                    help="seconds of finished requests and arrivals the planner judges and forecasts from")
    srv.set_defaults(func=cmd_serve)

    wrk = sub.add_parser("worker", help="a prefill or decode worker that joins a router (tandem serve)")
    add_engine_args(wrk)
    wrk.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    wrk.add_argument("--router", required=True, help="the router's worker address, e.g. tcp://10.0.0.1:5600")
    wrk.add_argument("--worker-id", default=None)
    wrk.add_argument("--cores", default=None, help="pin to these cores (e.g. 0 or 0-3); threads follow")
    wrk.add_argument("--kv-transport", default="zmq", choices=["shm", "zmq"],
                     help="decode workers: receive KV by shared memory (same host only) or ZeroMQ/TCP")
    wrk.add_argument("--kv-host", default="127.0.0.1", help="decode workers: address the KV receiver binds")
    wrk.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # exit when it exits
    add_log_args(wrk)
    wrk.set_defaults(func=cmd_worker)

    from tandem.bench.cli import add_bench_parser
    from tandem.sim.cli import add_plan_parser, add_profile_parser

    add_bench_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    process = {"serve": "api", "worker": getattr(args, "worker_id", None) or f"{getattr(args, 'role', '')}-worker"}
    logs.setup(args.log_level, getattr(args, "log_format", None), process.get(args.command, args.command))
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
