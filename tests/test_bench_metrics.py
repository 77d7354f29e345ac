"""Metric arithmetic on hand-built request records: every number is worked out by hand."""

from __future__ import annotations

import math

import pytest

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.client import RequestRecord
from tandem.bench.metrics import (
    compute_metrics,
    max_concurrent_requests,
    max_output_tokens_per_s,
    meets_slos,
    metrics_by_category,
    parse_goodput,
    percentile_key,
)


def rec(i: int, start: float, ttft: float, itl: list[float], out: int, ok: bool = True, cat: str = "default",
        prompt_len: int = 10) -> RequestRecord:
    r = RequestRecord(i, i, 0, cat, prompt_len, out, start=start, success=ok, ttft=ttft, itl=itl, output_tokens=out)
    r.latency = ttft + sum(itl)
    if not ok:
        r.error = "boom"
    return r


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        rec(0, 0.0, 0.100, [0.020] * 4, 5),             # e2e 0.180, tpot 0.020
        rec(1, 0.0, 0.300, [0.050] * 2, 3),             # e2e 0.400, tpot 0.050
        rec(2, 0.5, 0.050, [], 1),                      # one token: no tpot, no itl
        rec(3, 0.5, 0.050, [0.020, 0.200], 3),          # e2e 0.270, tpot 0.110
        rec(4, 1.0, 0.0, [], 0, ok=False),              # failed: counted, never measured
    ]


def test_counts_and_throughputs(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration=2.0)
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 12
    assert m["request_throughput"] == 2.0
    assert m["output_throughput"] == 6.0
    assert m["total_token_throughput"] == 26.0
    assert m["request_goodput"] is None  # no SLO given


def test_latency_stats(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration=2.0, percentiles=[50, 90, 99])
    assert m["mean_ttft_ms"] == pytest.approx((100 + 300 + 50 + 50) / 4)
    assert m["median_ttft_ms"] == pytest.approx(75.0)
    assert m["p50_ttft_ms"] == pytest.approx(75.0)
    # Linear interpolation between order statistics (numpy's default, as vLLM uses): sorted
    # [50, 50, 100, 300], p90 sits at rank 2.7 -> 100 + 0.7 * 200.
    assert m["p90_ttft_ms"] == pytest.approx(240.0)
    # TPOT excludes the first token and the one-token request: [20, 50, 110].
    assert m["mean_tpot_ms"] == pytest.approx(60.0)
    assert m["median_tpot_ms"] == pytest.approx(50.0)
    # ITL pools every gap: 4 x 20, 2 x 50, 20, 200.
    assert m["mean_itl_ms"] == pytest.approx((80 + 100 + 20 + 200) / 8)
    assert m["median_itl_ms"] == pytest.approx(20.0)
    assert m["p99_itl_ms"] == pytest.approx(50 + 0.93 * 150)
    assert m["mean_e2el_ms"] == pytest.approx((180 + 400 + 50 + 270) / 4)
    assert m["std_e2el_ms"] == pytest.approx(math.sqrt(((180 - 225) ** 2 + 175 ** 2 + 175 ** 2 + 45 ** 2) / 4))


def test_goodput(records: list[RequestRecord]) -> None:
    # ttft <= 200 drops #1; tpot <= 60 drops #3; the one-token #2 has no TPOT to miss.
    m = compute_metrics(records, 2.0, goodput={"ttft": 200, "tpot": 60})
    assert m["request_goodput"] == 2 / 2.0
    assert [meets_slos(r, {"e2el": 270}) for r in records] == [True, False, True, True, False]
    assert compute_metrics(records, 4.0, goodput={"e2el": 269.9})["request_goodput"] == 2 / 4.0


def test_selected_metrics_and_percentile_names(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, 1.0, percentiles=[99.9], metrics=["ttft"])
    assert "p99.9_ttft_ms" in m and "mean_itl_ms" not in m and "p99_ttft_ms" not in m
    assert percentile_key(99) == "99" and percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_empty_and_invalid() -> None:
    m = compute_metrics([rec(0, 0, 0, [], 0, ok=False)], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:300", "tpot:50", "e2el:2000.5"]) == {"ttft": 300, "tpot": 50, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peaks(records: list[RequestRecord]) -> None:
    # In flight: #0 [0, .18], #1 [0, .4], #2 [.5, .55], #3 [.5, .77]; the failed #4 is a point at 1.0.
    assert max_concurrent_requests(records) == 2
    back_to_back = [rec(0, 0.0, 0.1, [], 1), rec(1, 0.1, 0.1, [], 1)]
    assert max_concurrent_requests(back_to_back) == 1
    # Chunks: #0 at .1,.12,.14,.16,.18 (1 token each), #1 at .3,.35,.4, #2 at .55, #3 at .55,.57,.77: all in second 0.
    assert max_output_tokens_per_s(records, 2.0) == 12.0
    late = rec(5, 1.5, 0.1, [0.1], 4)  # 2 chunks of 2 tokens, both in second 1
    assert max_output_tokens_per_s([*records, late], 2.0) == 12.0
    assert max_output_tokens_per_s([rec(0, 0, 0.1, [0.1], 4)], 0.5) == 8.0  # a run under a second: its rate


def test_by_category() -> None:
    rs = [rec(0, 0, 0.1, [0.01], 2, cat="short"), rec(1, 0, 0.5, [0.3], 2, cat="long"),
          rec(2, 0, 0.2, [0.03], 2, cat="short")]
    cats = metrics_by_category(rs, [99])
    assert set(cats) == {"long", "short"}
    assert cats["short"]["completed"] == 2 and cats["short"]["mean_ttft_ms"] == pytest.approx(150)
    assert cats["long"]["mean_itl_ms"] == pytest.approx(300)
    assert metrics_by_category(rs[:1]) == {}


def test_arrivals() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    a = arrival_offsets(2000, 10.0, 1.0, seed=1)
    assert a == arrival_offsets(2000, 10.0, 1.0, seed=1) and a != arrival_offsets(2000, 10.0, 1.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    bursty = arrival_offsets(2000, 10.0, 0.25, seed=1)
    bgaps = [y - x for x, y in zip(bursty, bursty[1:], strict=False)]
    # Gamma gaps with shape k have a coefficient of variation 1 / sqrt(k): 1 for Poisson, 2 for k = 1/4.
    cv = lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g))
    assert cv(gaps) == pytest.approx(1.0, rel=0.15) and cv(bgaps) == pytest.approx(2.0, rel=0.2)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0)
