"""Two or more result files side by side, each with its ratio to the first."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.bench.result_fields import metric_fields


def load(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "completed" not in data:
        raise ValueError(f"{path} is not a benchmark result (no 'completed' field)")
    return data


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _ratio(v: Any, base: Any) -> str:
    if not isinstance(v, int | float) or not isinstance(base, int | float) or isinstance(v, bool) or base == 0:
        return ""
    return f"{v / base:.2f}x"


def labels_for(paths: Sequence[str | Path], results: Sequence[dict[str, Any]]) -> list[str]:
    labels = [r.get("label") or Path(p).stem for p, r in zip(paths, results, strict=True)]
    # Equal labels (two runs of one server) would make the columns ambiguous.
    if len(set(labels)) < len(labels):
        labels = [Path(p).stem for p in paths]
    return labels


def compare_table(results: Sequence[dict[str, Any]], labels: Sequence[str],
                  fields: Sequence[str] | None = None) -> str:
    fields = list(fields) if fields else metric_fields(results[0])
    base = results[0]
    header = ["metric", labels[0]]
    for label in labels[1:]:
        header += [label, f"{label}/{labels[0]}"]
    rows = [header]
    for f in fields:
        row = [f, _fmt(base.get(f))]
        for r in results[1:]:
            row += [_fmt(r.get(f)), _ratio(r.get(f), base.get(f))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare_files(paths: Sequence[str | Path], fields: Sequence[str] | None = None) -> str:
    if len(paths) < 2:
        raise ValueError("compare needs at least two result files")
    results = [load(p) for p in paths]
    return compare_table(results, labels_for(paths, results), fields)


def compare_html(paths: Sequence[str | Path], report: str | Path) -> Path:
    """The runs on one HTML page (html_report.py), with each run's per-request records when
    they were saved next to it."""
    from tandem.bench import html_report
    from tandem.bench.report import load_records

    results = [load(p) for p in paths]
    records = []
    for p in paths:
        sibling = Path(p).with_suffix(".requests.jsonl")
        records.append(load_records(sibling) if sibling.exists() else None)
    return html_report.write(html_report.compare_report(results, labels_for(paths, results), records), report)
