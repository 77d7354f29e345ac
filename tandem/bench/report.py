"""The result: one JSON object with vLLM's field names, a console summary, per-request records."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.bench.client import RequestRecord
from tandem.bench.metrics import METRICS, percentile_key

_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
WIDTH = 50


def json_rate(rate: float) -> float | str:
    # vLLM writes an unlimited rate as the string "inf" (JSON has no infinity).
    return "inf" if math.isinf(rate) else rate


def detailed_fields(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's --save-detailed arrays (seconds, one entry per request)."""
    return {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_tokens for r in records],
            "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
            "start_times": [r.start for r in records], "generated_texts": [r.generated_text for r in records],
            "errors": [r.error for r in records]}


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}" if title else fill * WIDTH


def format_console(result: dict[str, Any], percentiles: Sequence[float], metrics: Sequence[str] = METRICS) -> str:
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [_line("Benchmark duration (s):", result["duration"]),
              _line("Total input tokens:", result["total_input_tokens"]),
              _line("Total generated tokens:", result["total_output_tokens"]),
              _line("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
              _line("Peak concurrent requests:", result["max_concurrent_requests"]),
              _line("Total token throughput (tok/s):", result["total_token_throughput"])]
    for name in metrics:
        title, short = _TITLES[name]
        lines.append(_rule(title, "-"))
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"P{key} {short} (ms):", result[f"p{key}_{name}_ms"]))
    cats = result.get("by_category") or {}
    if cats:
        lines.append(_rule(" By category ", "-"))
        top = percentile_key(max(percentiles)) if percentiles else None
        cols = [("mean", n) for n in metrics] + ([(f"p{top}", n) for n in metrics] if top else [])
        header = f"{'category':<10}{'ok':>5}{'fail':>5}" + "".join(f"{f'{s} {n}':>12}" for s, n in cols)
        lines.append(header)
        for cat, row in cats.items():
            lines.append(f"{cat:<10}{row['completed']:>5}{row['failed']:>5}"
                         + "".join(f"{row[f'{s}_{n}_ms']:>12.2f}" for s, n in cols))
        lines.append("(latencies in ms)")
    lines.append(_rule("", "="))
    return "\n".join(lines)


def default_stem(result: dict[str, Any]) -> str:
    model = Path(str(result.get("model_id") or "model")).name.replace("/", "_")
    rate = result.get("request_rate", "inf")
    rate_s = "inf" if rate == "inf" else f"{float(rate):g}"
    return f"{result.get('backend', 'openai')}-{rate_s}qps-concurrency{result.get('max_concurrency')}-{model}-" \
           f"{result.get('date', datetime.now().strftime('%Y%m%d-%H%M%S'))}"


def result_paths(result: dict[str, Any], result_dir: str | None, result_filename: str | None) -> dict[str, Path]:
    """Where the JSON, the per-request records and the plots go: all share the result's stem."""
    directory = Path(result_dir or ".")
    name = result_filename or default_stem(result) + ".json"
    stem = name[:-5] if name.endswith(".json") else name
    return {"result": directory / name, "records": directory / f"{stem}.requests.jsonl",
            "latency_cdf": directory / f"{stem}.latency_cdf.png",
            "itl_over_time": directory / f"{stem}.itl_over_time.png",
            "throughput": directory / f"{stem}.throughput.png"}


def save_result(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def record_row(r: RequestRecord) -> dict[str, Any]:
    row = asdict(r)
    tpot = r.tpot
    row |= {"ttft_ms": r.ttft * 1000 if r.success else None, "tpot_ms": None if tpot is None else tpot * 1000,
            "e2el_ms": r.latency * 1000 if r.success else None}
    return row


def save_records(records: Sequence[RequestRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(record_row(r)) + "\n")


def load_records(path: Path) -> list[RequestRecord]:
    fields = set(RequestRecord.__dataclass_fields__)
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [RequestRecord(**{k: v for k, v in row.items() if k in fields}) for row in rows]
