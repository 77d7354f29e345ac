"""The router of `tandem serve` with workers (local processes or Ray actors), built from its flags."""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.args import engine_argv


def disaggregated_engine(args: argparse.Namespace, config: EngineConfig, tokenizer: Any) -> Any:
    """A DisaggEngine for the flags: the workers this host starts, routing, the planner."""
    from tandem.disagg.fleet.local_launcher import local_launcher
    from tandem.disagg.router.disagg_engine import DisaggEngine
    from tandem.disagg.router.settings import RouterSettings
    from tandem.disagg.worker.wire import SECRET_ENV, new_secret
    from tandem.policy.planner import PlannerSettings
    from tandem.policy.routing import RoutingSettings
    from tandem.slo import Slo

    secret = os.environ.get(SECRET_ENV, "").encode() or new_secret().hex().encode()
    launch = None
    num_local = args.prefill_workers + args.decode_workers + args.workers
    role_argv = {"prefill": shlex.split(args.prefill_worker_args), "decode": shlex.split(args.decode_worker_args)}
    # A lone worker is the deployment's one engine: admission predicts from its step times, as the
    # single server's (several are predicted from their measured rates: not timed).
    worker_argv = [*engine_argv(args), *(["--profile-speed"] if num_local == 1 and args.admission != "off" else [])]
    bind = args.router_bind or "tcp://127.0.0.1:0"
    if args.ray:
        from tandem.disagg.fleet.ray_launcher import connect, ray_launcher

        if not num_local:
            raise ValueError("--ray places workers: give --prefill-workers/--decode-workers or --workers")
        # Workers on other hosts connect back to this node's address (as the cluster knows it), unless
        # --router-bind says where; a loopback router keeps the workers' KV on loopback too.
        node = connect(args.ray)
        bind = args.router_bind or f"tcp://{node}:0"
        loopback = bind.startswith(("tcp://127.", "tcp://localhost"))
        launch = ray_launcher(args.prefill_workers, args.decode_workers, args.workers, args.ray_worker_cpus,
                              worker_argv, role_argv, secret, args.log_level.upper(),
                              "127.0.0.1" if loopback else None)
    elif num_local:
        launch = local_launcher(args.prefill_workers, args.decode_workers, args.worker_cores, worker_argv,
                                role_argv, args.kv_transport, secret, args.log_level.upper(), args.workers)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    routing = RoutingSettings(args.routing_policy, args.routing_overlap_weight, args.routing_temperature,
                              args.routing_guard_ratio, paths=args.path_policy, slo=slo)
    planner = PlannerSettings(args.planner == "on", slo.ttft_s, slo.tpot_s, args.planner_interval,
                              window_s=args.planner_window, dwell_s=args.planner_dwell, margin=args.planner_margin,
                              cpu_share=args.planner_cpu_share)
    predictor = (planner_predictor(args.planner_profile, slo, args.path_policy)
                 if planner.enabled and args.planner_profile else None)
    settings = RouterSettings(bind=bind, secret=secret, expected_workers=num_local,
                              heartbeat_timeout=args.worker_heartbeat_timeout, migrate=args.planner_migration == "on",
                              kv_events_endpoint=args.kv_events_endpoint)
    return DisaggEngine(config, tokenizer, settings, launch=launch, routing=routing, planner=planner,
                        predictor=predictor)


def planner_profiles(specs: list[str]) -> dict[str, str]:
    """--planner-profile values: "PATH" (every role) or "ROLE=PATH"; colocated's is every other's default."""
    roles = ("colocated", "prefill", "decode")
    paths: dict[str, str] = {}
    for spec in specs:
        role, sep, path = spec.partition("=")
        if sep and role in roles:
            paths[role] = path
        elif sep and not any(c in role for c in "/\\."):
            raise ValueError(f"--planner-profile {spec!r}: the role is one of {', '.join(roles)}")
        else:
            paths.update(dict.fromkeys(roles, spec))
    if "colocated" not in paths:
        paths["colocated"] = next(iter(paths.values()))
    return paths


def planner_predictor(specs: list[str], slo: Any, path_policy: str) -> Any:
    from tandem.sim.predict import SimPredictor

    return SimPredictor.from_profiles(planner_profiles(specs), slo, path_policy)
