"""`tandem bench sim`: the bench client's workload and arrivals, run through the simulator instead of
a server, written as the same result JSON (`tandem bench compare` puts the two side by side)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

from tandem.bench.arrivals import session_offsets
from tandem.bench.metrics import compute_metrics, metrics_by_category, parse_goodput
from tandem.bench.report import format_console, json_rate, result_paths, save_records, save_result
from tandem.bench.runner import session_thinker
from tandem.bench.serve import load_bench_tokenizer, metrics_of, percentiles_of, workload_config
from tandem.bench.workloads import Session, Tokenizer, generate
from tandem.config import CacheConfig, SchedulerConfig
from tandem.sim.cluster import ClusterSim, Deployment, SimResult, SimSession, SimTurn
from tandem.sim.cost import CostModel, load_profile
from tandem.sim.speculation import SpecModel
from tandem.sim.store import SimStore, SimTier
from tandem.slo import Slo


def to_sim_sessions(sessions: list[Session], offsets: list[float], tokenizer: Tokenizer, think_time_s: float = 0.0,
                    seed: int = 0) -> list[SimSession]:
    """Token ids of each turn's text (the engine caches and routes by them), each session's start and
    the think times the bench client would draw."""
    out = []
    for i, (session, start) in enumerate(zip(sessions, offsets, strict=True)):
        think = session_thinker(think_time_s, seed, i)
        turns = [SimTurn(tokenizer.encode(t.prompt, add_special_tokens=False), t.expected_output_len, t.category)
                 for t in session.turns]
        out.append(SimSession(turns, start, [think() for _ in turns[1:]]))
    return out


def role_costs(args: argparse.Namespace) -> dict[str, CostModel]:
    base = load_profile(args.profile)
    costs: dict[str, CostModel] = {"colocated": base}
    if args.prefill_profile:
        costs["prefill"] = load_profile(args.prefill_profile)
    if args.decode_profile:
        costs["decode"] = load_profile(args.decode_profile)
    return costs


SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "enable_chunked_prefill")
CACHE_KEYS = ("block_size", "enable_prefix_caching")


def engine_configs(engine: dict[str, Any], overrides: dict[str, Any],
                   kv_events: bool) -> tuple[SchedulerConfig, CacheConfig, int]:
    """The profiled engine's scheduler settings (the profile records them), with flags given on top;
    and max_model_len."""
    settings = {**engine, **{k: v for k, v in overrides.items() if v is not None}}
    sched = SchedulerConfig(**{k: settings[k] for k in SCHEDULER_KEYS if k in settings})
    cache = CacheConfig(**{k: settings[k] for k in CACHE_KEYS if k in settings}, prefix_caching_hash_algo="builtin",
                        enable_kv_events=kv_events)
    return sched, cache, int(settings.get("max_model_len", 8192))


def simulate(sessions: list[SimSession], deployment: Deployment, costs: dict[str, CostModel],
             sched: SchedulerConfig, cache: CacheConfig, max_model_len: int, record_steps: bool = False,
             store: SimStore | None = None, **options: Any) -> SimResult:
    """options: ClusterSim's (slo, spec, instances_per_host)."""
    return ClusterSim(deployment, costs, sched, cache, max_model_len, record_steps, store, **options).run(sessions)


def spec_of(args: argparse.Namespace) -> SpecModel | None:
    if not getattr(args, "spec_draft_tokens", 0):
        return None
    return SpecModel.parse(args.spec_draft_tokens, args.spec_acceptance, args.spec_draft_rate)


def sim_store(specs: list[str] | None, cost: CostModel, block_size: int) -> SimStore | None:
    if not specs:
        return None
    block_bytes = cost.kv_bytes_per_token * block_size
    return SimStore([SimTier.parse(spec, block_bytes) for spec in specs], block_bytes)


def run_sim(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    percentiles, metrics = percentiles_of(args), metrics_of(args)
    goodput = parse_goodput(args.goodput)
    if args.dataset_name == "mooncake_trace" and not math.isinf(args.request_rate):
        out("note: the trace's timestamps set the arrivals; --request-rate is ignored")
    tokenizer = load_bench_tokenizer(args.tokenizer)
    sessions = generate(workload_config(args), tokenizer)
    offsets = session_offsets(sessions, args.request_rate, args.burstiness, args.seed)
    sim_sessions = to_sim_sessions(sessions, offsets, tokenizer, args.think_time, args.seed)
    if args.max_concurrency is not None:
        raise ValueError("the simulator replays open-loop arrivals; --max-concurrency is not simulated")
    deployment = Deployment.parse(args.deployment, args.routing, args.path_policy)
    costs = role_costs(args)
    overrides = {k: getattr(args, k, None) for k in (*SCHEDULER_KEYS, *CACHE_KEYS, "max_model_len")}
    sched, cache, max_model_len = engine_configs(costs["colocated"].engine, overrides, args.routing == "kv")
    store = sim_store(args.store_tier, costs["colocated"], cache.block_size)
    if store is not None and not cache.enable_prefix_caching:
        raise ValueError("the KV store keys blocks as prefix caching does: leave prefix caching on")
    spec = spec_of(args)
    res = simulate(sim_sessions, deployment, costs, sched, cache, max_model_len, store=store,
                   slo=Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000), spec=spec,
                   instances_per_host=args.instances_per_host)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": "tandem-sim",
        "deployment": deployment.describe(),
        "profile": args.profile,
        "routing": args.routing,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "num_requests": len(res.records),
        "request_rate": json_rate(args.request_rate),
        "burstiness": args.burstiness,
        "seed": args.seed,
        "goodput": goodput or None,
        "model_id": "simulated",
        "gpus": sum(w.cost.num_devices for w in res.instances),
        "busy_fraction": {w.name: round(w.busy_s / res.duration, 4) for w in res.instances},
        "path_policy": deployment.path_policy,
    }
    if spec is not None:
        drafts = sum(w.num_drafts for w in res.instances)
        result["spec_decode"] = {"num_drafts": drafts, "accepted_per_draft":
                                 round(sum(w.num_accepted for w in res.instances) / max(drafts, 1), 3)}
    if store is not None:
        result["store_hit_blocks"] = {t.name: t.hits for t in store.tiers}
    result |= compute_metrics(res.records, res.duration, percentiles, metrics, goodput)
    by_cat = metrics_by_category(res.records, percentiles, metrics)
    if by_cat:
        result["by_category"] = by_cat
    out(format_console(result, percentiles, metrics))
    if args.save_result:
        paths = result_paths(result, args.result_dir, args.result_filename)
        save_result(result, paths["result"])
        save_records(res.records, paths["records"])
        out(f"saved {paths['result']} and {paths['records']}")
    if args.report:
        from tandem.bench import html_report

        out(f"report: {html_report.write(html_report.run_report(result, res.records), args.report)}")
    return result
