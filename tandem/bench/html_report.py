"""`--report FILE.html`: one self-contained page (inline CSS, plots as embedded PNG, no script, no
link out) with a run's settings, its metrics and its plots; or several runs side by side, each
with its ratio to the first, their latency CDFs on shared axes."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.bench.client import RequestRecord
from tandem.bench.result_fields import metric_fields

# Result fields that describe the run rather than measure it, in display order.
SETTINGS = ("label", "date", "backend", "base_url", "endpoint", "model_id", "tokenizer_id", "dataset_name",
            "num_prompts", "num_requests", "request_rate", "burstiness", "max_concurrency", "ignore_eos", "seed",
            "goodput")
_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330; margin: 24px auto;
  max-width: 1100px; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 16px; margin-top: 28px; }
.muted { color: #6b7385; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 8px 0; }
th, td { padding: 4px 10px; border-bottom: 1px solid #dde1e8; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { font-size: 12px; color: #6b7385; }
td.better { color: #0c6b50; } td.worse { color: #8e231d; }
img { max-width: 100%; border: 1px solid #dde1e8; border-radius: 6px; margin: 6px 0; }
code { background: #f1f3f6; padding: 1px 5px; border-radius: 4px; }
"""
# Metrics where more is better; for the other numeric ones (latencies, failures, duration) less is.
_MORE_IS_BETTER = ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                   "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s")


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.2f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x:g}" if isinstance(x, int | float) else f"{k}: {x}" for k, x in v.items())
    return str(v)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], classes: Sequence[Sequence[str]] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = classes[i] if classes else [""] * len(row)
        body.append("<tr>" + "".join(f'<td class="{c}">{html.escape(v)}</td>' if c else f"<td>{html.escape(v)}</td>"
                                     for v, c in zip(row, cls, strict=True)) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _page(title: str, body: str) -> str:
    made = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<div class="muted">written by tandem bench at {made}</div>{body}</body></html>\n')


def _category_table(result: dict[str, Any]) -> str:
    cats = result.get("by_category") or {}
    if not cats:
        return ""
    names = [k for k in next(iter(cats.values())) if k.endswith("_ms") and not k.startswith("std_")]
    rows = [[cat, str(row["completed"]), str(row["failed"]), *(_cell(row.get(n)) for n in names)]
            for cat, row in cats.items()]
    return "<h2>By workload category (ms)</h2>" + _table(["category", "completed", "failed", *names], rows)


def run_report(result: dict[str, Any], records: Sequence[RequestRecord], command: str | None = None) -> str:
    """One run: its settings, every metric, its category split and its three plots."""
    from tandem.bench import plots

    title = f"{result.get('label') or result.get('backend', 'benchmark')}: {result.get('model_id', '')}"
    settings = [[k, _cell(result.get(k))] for k in SETTINGS if result.get(k) is not None]
    body = ["<h2>Settings</h2>", _table(["setting", "value"], settings)]
    if command:
        body.append(f"<p>Command: <code>{html.escape(command)}</code></p>")
    body += ["<h2>Metrics</h2>", _table(["metric", "value"], [[f, _cell(result.get(f))]
                                                              for f in metric_fields(result)])]
    body.append(_category_table(result))
    ok = [r for r in records if r.success]
    if ok:
        body += ["<h2>Latency distributions</h2>", _img(plots.png(plots.latency_cdfs_figure({"": records})), "CDFs"),
                 "<h2>Inter-token latency over the run</h2>",
                 _img(plots.png(plots.itl_over_time_figure(records)), "ITL"), "<h2>Throughput over the run</h2>",
                 _img(plots.png(plots.throughput_over_time_figure(records, result["duration"])), "throughput")]
    else:
        body.append("<p>No request succeeded: nothing to plot.</p>")
    return _page(title, "".join(body))


def _ratio_class(field: str, v: Any, base: Any) -> str:
    if not isinstance(v, int | float) or not isinstance(base, int | float) or isinstance(v, bool) or v == base:
        return ""
    more = field in _MORE_IS_BETTER
    return "better" if (v > base) == more else "worse"


def compare_report(results: Sequence[dict[str, Any]], labels: Sequence[str],
                   records: Sequence[Sequence[RequestRecord] | None],
                   extra_plots: Sequence[tuple[str, bytes]] = ()) -> str:
    """Several runs: settings and metrics side by side (ratios to the first, coloured better or worse),
    and the latency CDFs of every run that kept its per-request records on one set of axes."""
    from tandem.bench import plots

    header = ["", *labels]
    settings = [[k, *(_cell(r.get(k)) for r in results)] for k in SETTINGS
                if any(r.get(k) is not None for r in results)]
    body = [_img(png, alt) for alt, png in extra_plots]
    body += ["<h2>Settings</h2>", _table(header, settings), "<h2>Metrics</h2>"]
    base = results[0]
    rows, classes = [], []
    metric_header = ["metric", labels[0]]
    for label in labels[1:]:
        metric_header += [label, f"/ {labels[0]}"]
    for f in metric_fields(base):
        row, cls = [f, _cell(base.get(f))], ["", ""]
        for r in results[1:]:
            v, b = r.get(f), base.get(f)
            ratio = f"{v / b:.2f}x" if isinstance(v, int | float) and isinstance(b, int | float) and b else ""
            row += [_cell(v), ratio]
            cls += ["", _ratio_class(f, v, b)]
        rows.append(row)
        classes.append(cls)
    body.append(_table(metric_header, rows, classes))
    kept = {label: recs for label, recs in zip(labels, records, strict=True) if recs}
    if kept:
        body += ["<h2>Latency distributions</h2>", _img(plots.png(plots.latency_cdfs_figure(kept)), "CDFs")]
    missing = [label for label, recs in zip(labels, records, strict=True) if not recs]
    if missing:
        body.append(f'<p class="muted">No per-request records next to {", ".join(missing)} '
                    "(run with --save-result to keep them): not in the distributions.</p>")
    return _page(f"{len(results)} benchmark runs", "".join(body))


def write(page: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
