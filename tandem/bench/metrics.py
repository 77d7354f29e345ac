"""The arithmetic: per-request records -> the field's metrics, named as `vllm bench serve` names them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tandem.bench.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """`["ttft:300", "tpot:50"]` -> {"ttft": 300.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}; got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must not be negative")
    return slos


def parse_list(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def percentile_key(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's spelling in p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO given; a one-token request has no TPOT to miss."""
    if not record.success:
        return False
    if "ttft" in slos and record.ttft * 1000 > slos["ttft"]:
        return False
    if "e2el" in slos and record.latency * 1000 > slos["e2el"]:
        return False
    tpot = record.tpot
    return not ("tpot" in slos and tpot is not None and tpot * 1000 > slos["tpot"])


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000
    empty = ms.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
           f"std_{name}_ms": 0.0 if empty else float(ms.std())}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def metric_values(records: Sequence[RequestRecord], name: str) -> list[float]:
    """A metric's samples in seconds over the successful requests (ITL: every gap of every request)."""
    ok = [r for r in records if r.success]
    if name == "ttft":
        return [r.ttft for r in ok]
    if name == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if name == "itl":
        return [gap for r in ok for gap in r.itl]
    if name == "e2el":
        return [r.latency for r in ok]
    raise ValueError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")


def token_events(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(time, tokens) per content chunk, time in seconds after the start.

    A chunk may carry several tokens and the stream does not say how many, so each request's
    output tokens are spread evenly over its chunks.
    """
    times: list[float] = []
    tokens: list[float] = []
    for r in records:
        chunk_times = r.chunk_times()
        if chunk_times:
            times += chunk_times
            tokens += [r.output_tokens / len(chunk_times)] * len(chunk_times)
    return np.asarray(times), np.asarray(tokens)


def max_output_tokens_per_s(records: Sequence[RequestRecord], duration: float, bin_s: float = 1.0) -> float:
    """The busiest whole-second window's output tokens (a one-second bin; a shorter run counts as one bin)."""
    times, tokens = token_events(records)
    if times.size == 0:
        return 0.0
    if duration < bin_s:
        return float(tokens.sum() / max(duration, 1e-9))
    bins = np.floor(times / bin_s).astype(int)
    return float(np.bincount(bins, weights=tokens).max() / bin_s)


def max_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (a request is in flight from its send to its last chunk)."""
    events = []
    for r in records:
        end = r.start + (r.latency if r.success else 0.0)
        events += [(r.start, 1), (end, -1)]
    # Ends sort before starts at the same instant: back-to-back requests do not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    metrics: Sequence[str] = METRICS, goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM-named metrics. Latencies in milliseconds, throughputs per second of `duration`."""
    if duration <= 0 or not math.isfinite(duration):
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(meets_slos(r, goodput) for r in ok) / duration) if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max_output_tokens_per_s(records, duration),
        "max_concurrent_requests": max_concurrent_requests(records),
    }
    for name in metrics:
        out |= _stats(name, metric_values(records, name), percentiles)
    return out


def metrics_by_category(records: Sequence[RequestRecord], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                        metrics: Sequence[str] = METRICS) -> dict[str, dict[str, Any]]:
    """Latency stats per workload category (long/short, turn1/turn2...); empty for a one-category run."""
    cats = sorted({r.category for r in records})
    if len(cats) < 2:
        return {}
    out = {}
    for cat in cats:
        sub = [r for r in records if r.category == cat]
        row: dict[str, Any] = {"completed": sum(r.success for r in sub), "failed": sum(not r.success for r in sub)}
        for name in metrics:
            row |= _stats(name, metric_values(sub, name), percentiles)
        out[cat] = row
    return out
