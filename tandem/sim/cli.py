"""The command lines: `tandem profile`, `tandem bench sim` and `tandem plan`."""

from __future__ import annotations

import argparse
import os
import sys

from tandem.policy.paths import PATH_POLICIES
from tandem.policy.routing import POLICIES
from tandem.sim.cost import RooflineCost, save_profile
from tandem.sim.hardware import GPUS, LINKS, gpu
from tandem.sim.model_shape import PRESETS, model_shape
from tandem.slo import DEFAULT_SLO


def _progress(text: str) -> None:
    print(f"[profile] {text}", file=sys.stderr, flush=True)


def _cmd_profile(args: argparse.Namespace) -> int:
    if args.collectives:
        from tandem.sim.collectives import measure_collectives, save

        fit = measure_collectives(args.group_size, args.device)
        save(fit, args.collectives)
        links = "; ".join(f"{kind} {link.latency_s * 1e6:.1f} us + {link.bandwidth / 1e9:.2f} GB/s"
                          for kind, link in fit.links.items())
        print(f"{fit.ranks} ranks over {fit.backend} ({fit.device}): {links}; the fits within "
              f"{fit.max_error * 100:.0f}% of every point; wrote {args.collectives}")
        for kind, nbytes, measured, predicted in fit.points:
            print(f"  {kind:10} {nbytes / 1024:9.1f} KiB  measured {measured * 1e6:8.1f} us  "
                  f"fitted {predicted * 1e6:8.1f} us")
        return 0
    if args.gpu:
        shape = model_shape(args.model_shape or "llama-13b", args.weight_bytes)
        cost = RooflineCost(gpu(args.gpu, args.inter_node), shape, args.tp, args.kv_link)
        save_profile(cost, args.output)
        print(f"{args.gpu} x{args.tp}, {shape.name} ({shape.total_params / 1e9:.1f}B params, "
              f"{shape.weight_bytes / 1e9:.1f} GB): room for {cost.kv_capacity_tokens():,} KV tokens; "
              f"wrote {args.output}")
        return 0
    import shlex
    from pathlib import Path

    from tandem.config import EngineConfig
    from tandem.engine.args import engine_argv, engine_kwargs
    from tandem.sim.measure import ProfileGrid, profile

    if args.cores:
        from tandem.disagg.fleet.local_launcher import parse_cores

        os.sched_setaffinity(0, parse_cores(args.cores))
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    grid = ProfileGrid.quick() if args.quick else ProfileGrid()
    transports = tuple(t for t in args.transports.split(",") if t)
    serve_argv = [*engine_argv(args), *shlex.split(args.serve_args)] if args.serve_calibration else None
    neighbour_argv = engine_argv(args) if args.neighbours and args.cores else None
    cost, steps = profile(config, grid, _progress, transports, serve_argv, Path(args.output).parent, neighbour_argv)
    save_profile(cost, args.output)
    err = cost.meta["fit_error"]
    print(f"{len(steps)} steps; fitted step time within {err['median'] * 100:.1f}% (median), "
          f"{err['p90'] * 100:.1f}% (p90) of measured (steps of one shape: {err['repeat_spread_median'] * 100:.1f}% "
          f"/ {err['repeat_spread_p90'] * 100:.1f}% from their median); wrote {args.output}")
    for kind, fit in cost.transports.items():
        print(f"  {kind}: {fit.latency_s * 1e3:.2f} ms + {fit.bandwidth / 1e9:.2f} GB/s")
    if cost.neighbours is not None:
        rows = ", ".join(f"{own} beside {theirs} +{v * 100:.0f}%" for own, row in cost.neighbours.slowdown.items()
                         for theirs, v in row.items())
        print(f"  co-location: {rows}")
    if cost.serving is not None:
        scale, overhead, per_seq = cost.serving
        print(f"  serving: a step is {scale:.2f}x the engine's + {overhead * 1e3:.2f} ms + {per_seq * 1e3:.3f} ms "
              "a sequence")
    return 0


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    from tandem.engine.args import add_engine_args

    p = sub.add_parser("profile", help="measure this engine's step and transfer costs (or price a GPU's) "
                                       "into a profile for `tandem bench sim` and `tandem plan`")
    add_engine_args(p)
    p.add_argument("--output", "-o", default="profile.json", help="where the profile goes")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for a smoke test)")
    p.add_argument("--transports", default="shm,zmq", help="KV transports to time (comma-separated)")
    p.add_argument("--cores", default=None, help="pin to these cores (as a worker is pinned), e.g. 0 or 0-1")
    p.add_argument("--neighbours", action=argparse.BooleanOptionalAction, default=True,
                   help="with --cores: time prefill and decode steps beside a neighbour engine on the other cores "
                        "(the co-location term the simulator applies to instances sharing a host)")
    p.add_argument("--serve-calibration", action=argparse.BooleanOptionalAction, default=True,
                   help="then time the same engine behind `tandem serve` from a client: what serving adds a step")
    p.add_argument("--serve-args", default="",
                   help="flags for that server (for a worker's profile: '--workers 1 --worker-cores 0', one "
                        "colocated worker behind a router)")
    c = p.add_argument_group("a worker group's collectives (no model): the link `tandem plan --intra-link` uses")
    c.add_argument("--collectives", default=None, metavar="FILE",
                   help="time all-reduce and all-to-all between --group-size ranks on --device, fit a link, write it")
    c.add_argument("--group-size", type=int, default=2)
    c.add_argument("--device", default="cpu", help="cpu (shared memory between processes) or cuda (NCCL)")
    g = p.add_argument_group("analytic profile (no engine runs): a GPU's data sheet and a model's shape")
    g.add_argument("--gpu", default=None, choices=sorted(GPUS), help="price steps on this GPU instead of measuring")
    g.add_argument("--model-shape", default=None,
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json (default llama-13b)")
    g.add_argument("--weight-bytes", type=float, default=None, help="bytes a weight (default: the preset's)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallelism within a node")
    g.add_argument("--kv-link", default="inter", choices=["intra", "inter"],
                   help="prefill-to-decode KV: NVLink (same node) or the RDMA NIC")
    g.add_argument("--inter-node", default=None, choices=sorted(LINKS), help="the NIC (default rdma-400g)")
    p.set_defaults(func=_cmd_profile)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the simulated deployment")
    g.add_argument("--profile", required=True, help="a profile JSON (`tandem profile`) for every instance")
    g.add_argument("--prefill-profile", default=None, help="prefill instances' own profile (default --profile)")
    g.add_argument("--decode-profile", default=None, help="decode instances' own profile (default --profile)")
    g.add_argument("--deployment", default="1C", help="instances: 1C (colocated), 1P1D, 2P4D, 1P1D1C...")
    g.add_argument("--routing", default="least-loaded", choices=POLICIES, help="the router's policy in each pool")
    g.add_argument("--path-policy", default="slo", choices=PATH_POLICIES,
                   help="as the router's: slo takes each request's path (whole on one instance, or through a "
                        "prefill/decode pair) by its predicted TTFT and TPOT against the SLOs; disaggregated sends "
                        "every prompt through a pair")
    g.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO.ttft_s * 1000, help="what the path choice "
                   "scores against, as `tandem serve --slo-ttft-ms`")
    g.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO.tpot_s * 1000)
    g.add_argument("--instances-per-host", type=int, default=0,
                   help="instances sharing one host's cores and memory, in order (0: all, as on one machine); a "
                        "profile's measured neighbour slowdown applies among them")
    sp = p.add_argument_group("speculative decoding (from a live run's spec_decode_* counters)")
    sp.add_argument("--spec-draft-tokens", type=int, default=0, help="tokens a draft holds (0: off)")
    sp.add_argument("--spec-acceptance", default="0.5",
                    help="each position's acceptance given the ones before it: one probability, or one per "
                         "position, comma-separated")
    sp.add_argument("--spec-draft-rate", type=float, default=1.0, help="share of decode rows that carry a draft")
    g.add_argument("--store-tier", action="append", default=None, metavar="NAME:GIB:GBPS[:LATENCY_MS]",
                   help="a tier of the KV store every instance shares, fastest first (repeatable), e.g. "
                        "host:16:8 then disk:200:2:0.1")
    e = p.add_argument_group("engine settings (default: as the profile recorded them)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--long-prefill-token-threshold", type=int, default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)


def _cmd_sim(args: argparse.Namespace) -> int:
    from tandem.sim.run import run_sim

    result = run_sim(args)
    return 0 if result["completed"] else 1


def add_sim_parser(bench_sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    from tandem.bench.cli import add_load_args, add_output_args, add_workload_args

    p = bench_sub.add_parser("sim", help="the same benchmark on a simulated deployment (a profile's costs)",
                             formatter_class=formatter)
    add_sim_args(p)
    p.add_argument("--tokenizer", default=None, help="tokenizes the workload (default: the default model's)")
    add_load_args(p)
    add_output_args(p)
    add_workload_args(p)
    p.set_defaults(func=_cmd_sim)


def _cmd_plan(args: argparse.Namespace) -> int:
    from tandem.sim.plan_cli import run_plan

    rows = run_plan(args)
    return 0 if rows else 1


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from tandem.bench.cli import add_workload_args

    p = sub.add_parser("plan", help="the deployment with the most goodput per GPU for a traffic and its SLOs")
    g = p.add_argument_group("what to deploy")
    g.add_argument("--profile", default=None,
                   help="a measured profile (this machine: every instance one such engine; tp 1 only)")
    g.add_argument("--gpu", default="H100", choices=sorted(GPUS), help="or price instances on this GPU")
    g.add_argument("--model-shape", default="llama-13b", help=f"a preset ({', '.join(PRESETS)}) or a config.json")
    g.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes to consider per phase")
    g.add_argument("--max-gpus", type=int, default=8, help="GPUs a candidate may use")
    g.add_argument("--max-instances", type=int, default=4, help="instances per pool a candidate may have")
    g.add_argument("--kv-link", default="inter", choices=["intra", "inter"])
    g.add_argument("--intra-link", default=None, metavar="FILE",
                   help="price the node's links (TP all-reduces, on-node all-to-alls) with a measured link "
                        "(`tandem profile --collectives FILE`) instead of the data sheet's")
    m = p.add_argument_group("mixture of experts (a MoE --model-shape plans the decode pool's expert parallelism)")
    m.add_argument("--ep-widths", default="8,16,32,64,128,256", help="decode pool widths (GPUs) to consider")
    m.add_argument("--context", type=int, default=4096, help="mean tokens of context a decoding stream holds")
    m.add_argument("--expert-skew", type=float, default=0.6,
                   help="Zipf exponent of the experts' popularity (0: uniform)")
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, ms (required for dense models)")
    s.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO, ms")
    s.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    o = p.add_argument_group("output")
    o.add_argument("--tokenizer", default=None, help="tokenizes the workload (default: the default model's)")
    o.add_argument("--output", default=None, help="write the ranked table as JSON here")
    o.add_argument("--plot", default=None, help="write attainment vs rate per GPU (PNG) here")
    o.add_argument("--top", type=int, default=15, help="rows to print")
    o.add_argument("--max-num-batched-tokens", type=int, default=None, help="every instance's token budget "
                   "(default: the profile's; an analytic profile's is 2048)")
    o.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="(default: the profile's, on) --no-enable-chunked-prefill plans against colocation as "
                        "engines without chunked prefill run it, as DistServe compared")
    o.add_argument("--span", type=float, default=10.0,
                   help="seconds of arrivals each probe simulates (capped by --num-prompts requests)")
    add_workload_args(p)
    p.set_defaults(func=_cmd_plan, num_prompts=1000)
