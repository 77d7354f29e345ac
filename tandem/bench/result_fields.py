"""Which fields of a result a comparison shows, in display order: the console table (compare.py) and the
HTML page (html_report.py) show the same rows."""

from __future__ import annotations

from typing import Any

# The headline fields, in display order; latency fields are added from whatever the result holds.
HEADLINE = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s")
_LATENCY_ORDER = ("ttft", "tpot", "itl", "e2el")


def latency_fields(result: dict[str, Any]) -> list[str]:
    def order(key: str) -> tuple[int, int, str]:
        stat, _, rest = key.partition("_")
        name = rest.removesuffix("_ms")
        rank = {"mean": 0, "median": 1, "std": 2}.get(stat, 3)
        return (_LATENCY_ORDER.index(name), rank, stat)

    keys = [k for k, v in result.items() if k.endswith("_ms") and isinstance(v, int | float)
            and k.partition("_")[2].removesuffix("_ms") in _LATENCY_ORDER and not k.startswith("std_")]
    return sorted(keys, key=order)


def metric_fields(result: dict[str, Any]) -> list[str]:
    """The headline fields the result holds, then its latency fields."""
    return [f for f in HEADLINE if f in result] + latency_fields(result)
