"""`tandem plan`'s run: the traffic from the bench's generators, candidates priced on a GPU (or on a
measured profile), the search, the table, the JSON and the plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.bench.metrics import parse_list
from tandem.bench.serve import load_bench_tokenizer, workload_config
from tandem.bench.workloads import generate
from tandem.sim.cluster import SimSession
from tandem.sim.collectives import load as load_collectives
from tandem.sim.cost import CostModel, RooflineCost, StepShape, load_profile
from tandem.sim.hardware import Hardware, gpu
from tandem.sim.model_shape import model_shape
from tandem.sim.moe import WidthRow, format_width_table, plan_expert_parallel
from tandem.sim.plan import Planner, PlanRow, format_table, plot_curves
from tandem.sim.run import engine_configs, to_sim_sessions

CostMaker = Callable[[str, int], CostModel]


def node(args: argparse.Namespace) -> Hardware:
    """The GPU by data sheet, its node's links measured where --intra-link gives them."""
    hw = gpu(args.gpu)
    if getattr(args, "intra_link", None):
        links = load_collectives(args.intra_link).links
        hw = replace(hw, intra_node=links["all_reduce"], intra_node_all_to_all=links["all_to_all"])
        print("links within a node (measured, " + args.intra_link + "): " + "; ".join(
            f"{link.name} {link.latency_s * 1e6:.1f} us + {link.bandwidth / 1e9:.2f} GB/s" for link in links.values()))
    return hw


def cost_maker(args: argparse.Namespace) -> tuple[CostMaker, dict[str, Any]]:
    if args.profile:
        measured = load_profile(args.profile)

        def measured_cost(role: str, tp: int) -> CostModel:
            if tp != 1:
                raise ValueError("a measured profile is one engine: plan it with --tp 1")
            return measured

        return measured_cost, measured.engine
    hw, shape = node(args), model_shape(args.model_shape)
    cache: dict[int, RooflineCost] = {}

    def roofline(role: str, tp: int) -> CostModel:
        if tp not in cache:
            cache[tp] = RooflineCost(hw, shape, tp, args.kv_link)
        return cache[tp]

    return roofline, roofline("colocated", 1).engine


def start_rate(make_cost: CostMaker, sessions: list[SimSession], tp: int) -> float:
    """A first rate to probe per GPU: what one instance could do if it never waited (prompt and
    output tokens at a batched step's pace)."""
    cost = make_cost("colocated", tp)
    mean_in = sum(len(t.prompt) for s in sessions for t in s.turns) / max(sum(len(s.turns) for s in sessions), 1)
    mean_out = sum(t.max_tokens for s in sessions for t in s.turns) / max(sum(len(s.turns) for s in sessions), 1)
    prefill = cost.step_time(StepShape.of([(int(mean_in), 0, True)]))
    decode = cost.step_time(StepShape.of([(1, int(mean_in), True)] * 32)) / 32
    return 0.5 / (prefill + decode * mean_out) / tp


def run_moe_plan(args: argparse.Namespace) -> list[WidthRow]:
    """A mixture of experts: the decode pool's expert-parallel width (the prefill pool and the
    deployment's P/D split are the dense search's questions; this is the one MoE adds)."""
    hw, shape = node(args), model_shape(args.model_shape)
    widths = [int(x) for x in parse_list(args.ep_widths, "--ep-widths")]
    widths = [w for w in widths if shape.num_experts % w == 0]
    rows = plan_expert_parallel(hw, shape, widths, args.slo_tpot / 1000, args.context, args.expert_skew)
    best = max(rows, key=lambda r: (r.tokens_per_gpu, -r.width))
    print(f"{shape.name} decode on {hw.name}: TPOT <= {args.slo_tpot:g} ms, {args.context} tokens of context a "
          f"stream, expert popularity Zipf({args.expert_skew:g}); attention data-parallel, experts spread over "
          f"the pool, all-to-all over {hw.intra_node.name} within a node and {hw.inter_node.name} across nodes")
    print(format_width_table(rows))
    at_best = {r.variant: r.tokens_per_gpu for r in rows if r.width == best.width}
    print(f"\nchoice: EP width {best.width} ({best.variant}), {best.tokens_per_gpu:.0f} tokens/s per GPU; at that "
          f"width rebalancing gives {at_best['eplb'] / max(at_best['contiguous'], 1e-9):.2f}x the contiguous "
          f"placement's, and overlap {at_best['eplb+dbo'] / max(at_best['eplb'], 1e-9):.2f}x more")
    if args.output:
        Path(args.output).write_text(json.dumps([vars(r) for r in rows], indent=2) + "\n")
    return rows


def run_plan(args: argparse.Namespace) -> list[PlanRow] | list[WidthRow]:
    if not args.profile and model_shape(args.model_shape).is_moe:
        return run_moe_plan(args)
    if args.slo_ttft is None:
        raise ValueError("--slo-ttft is required (and --slo-tpot) to plan a dense model's deployment")
    tps = [int(x) for x in parse_list(args.tp, "--tp")]
    make_cost, engine = cost_maker(args)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    sessions = generate(workload_config(args), tokenizer)
    sim_sessions = to_sim_sessions(sessions, [0.0] * len(sessions), tokenizer, 0.0, args.seed)
    overrides = {"max_num_batched_tokens": args.max_num_batched_tokens,
                 "enable_chunked_prefill": args.enable_chunked_prefill}
    sched, cache, max_model_len = engine_configs(engine, overrides, False)
    planner = Planner(make_cost, sim_sessions, {"ttft": args.slo_ttft, "tpot": args.slo_tpot}, sched, cache,
                      max_model_len, args.attainment, args.seed, span_s=args.span)
    rate = start_rate(make_cost, sim_sessions, min(tps))
    rows = planner.search(tps, args.max_gpus, args.max_instances, rate, lambda s: print(s, file=sys.stderr, flush=True))
    where = args.profile or f"{args.gpu} / {args.model_shape}"
    print(f"\n{where}: TTFT <= {args.slo_ttft:g} ms and TPOT <= {args.slo_tpot:g} ms for "
          f"{args.attainment:.0%} of requests ({args.dataset_name}, up to {len(sim_sessions)} requests a probe, "
          f"arrivals over {planner.span_s:g} s)")
    for r in planner.simulated:
        what = {"prefill": "a prefill instance (TTFT)", "decode": "a decode instance (TPOT)"}.get(r.phase, "colocated")
        print(f"  {what}, tp{r.candidate.tp_decode if r.phase == 'decode' else r.candidate.tp_prefill}: "
              f"{r.goodput:.3f} req/s")
    print(format_table(rows, args.top))
    if args.output:
        Path(args.output).write_text(json.dumps([
            {"deployment": r.candidate.describe(), "gpus": r.candidate.gpus, "goodput": r.goodput,
             "goodput_per_gpu": r.goodput_per_gpu, "verified_attainment": r.verified, "curve": r.curve}
            for r in rows], indent=2) + "\n")
    if args.plot:
        print("plot:", plot_curves(planner.simulated, args.plot, f"{where}: SLO attainment vs load", args.attainment))
    return rows
