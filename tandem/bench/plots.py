"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)
import numpy as np  # noqa: E402

from tandem.bench.client import RequestRecord  # noqa: E402
from tandem.bench.metrics import METRICS, metric_values, token_events  # noqa: E402

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def png(fig: Any) -> bytes:
    """A figure as PNG bytes (for a self-contained HTML report), closed afterwards."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def latency_cdfs(records: Sequence[RequestRecord], path: Path, metrics: Sequence[str] = METRICS,
                 title: str = "") -> Path:
    return _save(latency_cdfs_figure({"": records}, metrics, title), path)


def latency_cdfs_figure(runs: dict[str, Sequence[RequestRecord]], metrics: Sequence[str] = METRICS,
                        title: str = "") -> Any:
    """One empirical CDF per metric: one line per run, or per workload category when one run has several."""
    if len(runs) == 1:
        [records] = runs.values()
        cats = sorted({r.category for r in records})
        if len(cats) > 1:
            runs = {c: [r for r in records if r.category == c] for c in cats}
    ncols = 2
    nrows = (len(metrics) + 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(10, 3.6 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, metrics, strict=False):
        groups = list(runs.items())
        for cat, sub in groups:
            ms = np.sort(np.asarray(metric_values(sub, name)) * 1000)
            if ms.size:
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=cat or None)
        ax.set_xlabel(f"{_NAMES[name]} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def itl_over_time(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    return _save(itl_over_time_figure(records, title), path)


def itl_over_time_figure(records: Sequence[RequestRecord], title: str = "") -> Any:
    """Every inter-chunk gap at the time its chunk arrived: prefill stalls show up as spikes."""
    fig, ax = plt.subplots(figsize=(10, 4))
    cats = sorted({r.category for r in records})
    for cat in cats:
        xs: list[float] = []
        ys: list[float] = []
        for r in records:
            if r.category == cat and r.success and r.itl:
                xs += r.chunk_times()[1:]
                ys += [g * 1000 for g in r.itl]
        if xs:
            ax.scatter(xs, ys, s=4, alpha=0.5, label=cat if len(cats) > 1 else None)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.grid(alpha=0.3)
    if len(cats) > 1:
        ax.legend(fontsize=8, markerscale=3)
    ax.set_title(title or "ITL over time")
    return fig


def throughput_over_time(records: Sequence[RequestRecord], duration: float, path: Path, title: str = "") -> Path:
    return _save(throughput_over_time_figure(records, duration, title), path)


def throughput_over_time_figure(records: Sequence[RequestRecord], duration: float, title: str = "",
                                bins: int = 60) -> Any:
    """Output tokens per second and requests in flight, over the run."""
    width = max(duration / bins, 1e-3)
    edges = np.arange(0, duration + width, width)
    times, tokens = token_events(records)
    rate = np.histogram(times, bins=edges, weights=tokens)[0] / width if times.size else np.zeros(len(edges) - 1)
    mids = (edges[:-1] + edges[1:]) / 2
    in_flight = [sum(r.start <= t < r.start + (r.latency if r.success else 0.0) for r in records) for t in mids]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(mids, rate, where="mid", color="tab:blue", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.step(mids, in_flight, where="mid", color="tab:orange", alpha=0.8, label="requests in flight")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax.set_title(title or "throughput over time")
    return fig


def sweep_plot(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    return _save(sweep_figure(rows, title), path)


def sweep_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Goodput (or throughput when no SLO was given) against the offered request rate."""
    finite = [r for r in rows if r["request_rate"] != "inf"]
    xs = [float(r["request_rate"]) for r in finite]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, xs, ls=":", color="gray", label="offered rate")
    ax.plot(xs, [r["request_throughput"] for r in finite], marker="o", label="request throughput")
    if any(r.get("request_goodput") is not None for r in finite):
        ax.plot(xs, [r.get("request_goodput") or 0.0 for r in finite], marker="s", label="goodput (met every SLO)")
    for r in rows:
        if r["request_rate"] == "inf":
            ax.axhline(r["request_throughput"], ls="--", color="tab:red", alpha=0.6, label="throughput at rate=inf")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("completed requests/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "goodput vs request rate")
    return fig
