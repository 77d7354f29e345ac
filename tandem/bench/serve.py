"""`tandem bench serve`: workload -> load loop -> metrics -> console, JSON, records, plots."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.client import EndpointConfig, RequestRecord
from tandem.bench.metrics import METRICS, compute_metrics, metrics_by_category, parse_goodput, parse_list
from tandem.bench.report import (
    detailed_fields,
    format_console,
    json_rate,
    result_paths,
    save_records,
    save_result,
)
from tandem.bench.runner import RunConfig, RunResult, run
from tandem.bench.workloads import Session, TextMaker, Tokenizer, WorkloadConfig, generate
from tandem.flags import json_object
from tandem.tokenizer import load_tokenizer

# Warm-up prompts come from another seed so they do not seed the prefix cache with the measured prompts.
WARMUP_SEED_OFFSET = 1_000_003


@dataclass
class Target:
    """The server under test, resolved once (a sweep reuses it)."""

    endpoint: EndpointConfig
    backend: str
    tokenizer: Tokenizer
    tokenizer_id: str
    maker: TextMaker


def resolve_base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def resolve_endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return args.endpoint
    return "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"


def fetch_model_id(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot read the model name from {base_url}/v1/models ({e}); give --model") from None


def load_bench_tokenizer(path: str | None) -> Tokenizer:
    """A local HF directory, a GGUF file, or (None) the default model's tokenizer. Never a hub download."""
    if path and Path(path).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer")
    return tokenizer


def resolve_target(args: argparse.Namespace, tokenizer: Tokenizer | None = None) -> Target:
    base_url = resolve_base_url(args)
    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    model = args.model or fetch_model_id(base_url, api_key)
    extra = parse_extra_body(args.extra_body)
    endpoint = EndpointConfig(base_url, resolve_endpoint(args), model, api_key, args.ignore_eos, args.temperature,
                              extra)
    tok = tokenizer if tokenizer is not None else load_bench_tokenizer(args.tokenizer)
    backend = "openai-chat" if endpoint.chat else "openai"
    return Target(endpoint, backend, tok, args.tokenizer or "default", TextMaker(tok))


def parse_extra_body(text: str | None) -> dict[str, Any]:
    return json_object(text, "--extra-body") if text else {}


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    names = {f.name for f in dataclasses.fields(WorkloadConfig)}
    return WorkloadConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def warmup_sessions(cfg: WorkloadConfig, maker: TextMaker, n: int) -> list[Session]:
    if n <= 0:
        return []
    sessions = generate(dataclasses.replace(cfg, seed=cfg.seed + WARMUP_SEED_OFFSET, num_prompts=n), maker)
    # One turn each, sent at once: a warm-up only has to get the server's code paths going.
    return [Session(s.turns[:1]) for s in sessions[:n]]


def percentiles_of(args: argparse.Namespace) -> list[float]:
    ps = parse_list(args.metric_percentiles, "--metric-percentiles")
    if any(not 0 < p < 100 for p in ps):
        raise ValueError("--metric-percentiles must be between 0 and 100")
    return ps


def metrics_of(args: argparse.Namespace) -> list[str]:
    names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    return names


def build_result(args: argparse.Namespace, target: Target, run_result: RunResult,
                 percentiles: list[float], metrics: list[str], goodput: dict[str, float]) -> dict[str, Any]:
    records = run_result.records
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": target.backend,
        "base_url": target.endpoint.base_url,
        "endpoint": target.endpoint.endpoint,
        "model_id": target.endpoint.model,
        "tokenizer_id": target.tokenizer_id,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "num_requests": len(records),
        "request_rate": json_rate(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "goodput": goodput or None,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
        result[key] = value
    result |= compute_metrics(records, run_result.duration, percentiles, metrics, goodput)
    by_cat = metrics_by_category(records, percentiles, metrics)
    if by_cat:
        result["by_category"] = by_cat
    if args.save_detailed:
        result |= detailed_fields(records)
    return result


def benchmark(args: argparse.Namespace, target: Target | None = None,
              out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one benchmark as the flags say; returns the result object (and saves/plots as asked)."""
    return run_benchmark(args, target, out)[0]


def run_benchmark(args: argparse.Namespace, target: Target | None = None,
                  out: Callable[[str], None] = print) -> tuple[dict[str, Any], list[RequestRecord]]:
    """benchmark(), and the per-request records it measured."""
    percentiles, metrics = percentiles_of(args), metrics_of(args)
    goodput = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    target = target or resolve_target(args)
    cfg = workload_config(args)
    sessions = generate(cfg, target.maker)
    if args.dataset_name == "mooncake_trace" and not math.isinf(args.request_rate):
        print("note: the trace's timestamps set the arrivals; --request-rate is ignored", file=sys.stderr)
    run_cfg = RunConfig(target.endpoint, args.request_rate, args.burstiness, args.max_concurrency, args.seed,
                        args.request_timeout, not args.disable_tqdm, args.think_time)
    tok = target.tokenizer
    run_result = run(run_cfg, sessions, lambda text: len(tok.encode(text, add_special_tokens=False)),
                     warmup_sessions(cfg, target.maker, args.num_warmups))
    result = build_result(args, target, run_result, percentiles, metrics, goodput)
    out(format_console(result, percentiles, metrics))
    failed = [r for r in run_result.records if not r.success]
    if failed:
        out(f"first error: {failed[0].error}")
    paths = result_paths(result, args.result_dir, args.result_filename)
    if args.save_result:
        save_result(result, paths["result"])
        save_records(run_result.records, paths["records"])
        out(f"saved {paths['result']} and {paths['records']}")
    if args.plot:
        from tandem.bench import plots

        title = f"{result['model_id']} @ {result['request_rate']} req/s"
        made = [plots.latency_cdfs(run_result.records, paths["latency_cdf"], metrics, title),
                plots.itl_over_time(run_result.records, paths["itl_over_time"], title),
                plots.throughput_over_time(run_result.records, run_result.duration, paths["throughput"], title)]
        out("plots: " + ", ".join(str(p) for p in made))
    if args.report:
        from tandem.bench import html_report

        out(f"report: {html_report.write(html_report.run_report(result, run_result.records), args.report)}")
    return result, run_result.records
