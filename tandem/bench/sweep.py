"""`tandem bench sweep`: one benchmark per request rate, then goodput against rate."""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.bench.metrics import parse_goodput, parse_list, percentile_key
from tandem.bench.report import save_result
from tandem.bench.serve import Target, percentiles_of, resolve_target, run_benchmark

# The columns a sweep keeps per rate (the full results are saved per rate with --save-result).
SWEEP_FIELDS = ("request_rate", "completed", "failed", "duration", "request_throughput", "request_goodput",
                "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms")


def parse_rates(text: str) -> list[float]:
    rates = parse_list(text, "--request-rates")
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("--request-rates needs positive rates, e.g. 1,2,4 (inf for all at once)")
    return rates


def _row(result: dict[str, Any], top: str | None) -> dict[str, Any]:
    row = {k: result.get(k) for k in SWEEP_FIELDS}
    if top is not None:
        for name in ("ttft", "tpot", "itl", "e2el"):
            key = f"p{top}_{name}_ms"
            if key in result:
                row[key] = result[key]
    return row


def format_sweep(rows: Sequence[dict[str, Any]]) -> str:
    keys = list(rows[0])
    cells = [keys] + [["-" if r[k] is None else f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k])
                       for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def sweep(args: argparse.Namespace, target: Target | None = None,
          out: Callable[[str], None] = print) -> dict[str, Any]:
    rates = parse_rates(args.request_rates)
    percentiles = percentiles_of(args)
    top = percentile_key(max(percentiles)) if percentiles else None
    target = target or resolve_target(args)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or f"sweep-{target.backend}-{Path(target.endpoint.model).name}-{date}.json"
    stem = name[:-5] if name.endswith(".json") else name
    directory = Path(args.result_dir or ".")
    rows = []
    results: list[dict[str, Any]] = []
    kept: list[list] = []
    for i, rate in enumerate(rates):
        out(f"--- request rate {rate:g} req/s")
        run_args = copy.copy(args)
        run_args.request_rate = rate
        # Same shape, fresh prompts: one run must not find its prompts in the prefix cache another left.
        run_args.seed = args.seed + i
        run_args.result_filename = f"{stem}-rate{rate:g}.json"
        run_args.report = None  # one report for the sweep, below
        result, records = run_benchmark(run_args, target, out)
        results.append(result)
        kept.append(records)
        rows.append(_row(result, top))
    summary = {"date": date, "label": args.label, "backend": target.backend, "model_id": target.endpoint.model,
               "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
               "max_concurrency": args.max_concurrency, "goodput": parse_goodput(args.goodput) or None, "runs": rows}
    out(format_sweep(rows))
    save_result(summary, directory / f"{stem}.json")
    from tandem.bench import plots

    title = f"{target.endpoint.model}: goodput vs rate"
    plot = plots.sweep_plot(rows, directory / f"{stem}.png", title)
    out(f"saved {directory / f'{stem}.json'} and {plot}")
    if args.report:
        from tandem.bench import html_report

        page = html_report.compare_report(results, [f"{r:g} req/s" for r in rates], kept,
                                          [("goodput vs rate", plots.png(plots.sweep_figure(rows, title)))])
        out(f"report: {html_report.write(page, args.report)}")
    if any(math.isinf(r) for r in rates) and len(rates) == 1:
        out("note: a sweep of only rate=inf has no rate axis to plot")
    return summary
