"""The report of benchmarks/kv_store.py: the goals, the console tables and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from kv_store_common import MiB, fmt, ratio
from rich.table import Table

GOALS = {"multi_turn_long_ttft_p50_tiers_over_pool": 0.2, "multi_turn_itl_p99_tiers_over_pool": 1.05,
         "probe_store_ttft_over_pool": 1.5}


def goals_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    mt = results.get("multi_turn", {}).get("runs", {})
    pool, tiers = mt.get("pool", {}), mt.get("tiers", {})
    probe = results.get("probe", {})
    values = {"multi_turn_long_ttft_p50_tiers_over_pool": ratio(tiers.get("long_ttft_p50_ms"),
                                                                pool.get("long_ttft_p50_ms")),
              "multi_turn_itl_p99_tiers_over_pool": ratio(tiers.get("itl_p99_ms"), pool.get("itl_p99_ms")),
              "probe_store_ttft_over_pool": probe.get("host_over_pool")}
    return {k: {"value": v, "goal": f"<= {GOALS[k]:g}", "met": None if v is None else v <= GOALS[k]}
            for k, v in values.items()}


ROWS = [("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p90 (ms)", "ttft_p90_ms"),
        ("returning TTFT p50 (ms)", "returning_ttft_p50_ms"), ("returning TTFT p90 (ms)", "returning_ttft_p90_ms"),
        ("history>=1k TTFT p50 (ms)", "long_ttft_p50_ms"), ("history>=1k TTFT p90 (ms)", "long_ttft_p90_ms"),
        ("ITL p50 (ms)", "itl_p50_ms"), ("ITL p99 (ms)", "itl_p99_ms"), ("duration (s)", "duration_s")]


def tables(results: dict[str, Any]) -> list[Table]:
    out = []
    for part in ("multi_turn", "trace"):
        runs = results.get(part, {}).get("runs", {})
        if not runs:
            continue
        t = Table(title=f"{part}: pool alone vs tiers")
        for col in ("measure", "pool", "tiers", "tiers/pool"):
            t.add_column(col, justify="left" if col == "measure" else "right")
        pool, tiers = runs.get("pool", {}), runs.get("tiers", {})
        for label, key in ROWS:
            if part == "trace" and key.startswith(("returning", "long")):
                continue
            a, b = pool.get(key), tiers.get(key)
            t.add_row(label, fmt(a), fmt(b), fmt(ratio(b, a), ".2f"))
        for label, key, spec in (("prompt tokens (server)", "prompt_tokens", ".0f"),
                                 ("preemptions", "preemptions", ".0f"),
                                 ("pool prefix hit rate", "pool_prefix_hit_rate", ".1%")):
            t.add_row(label, *(fmt(r.get("store", {}).get(key), spec) for r in (pool, tiers)), "")
        names = sorted({n for r in (pool, tiers) for n in r.get("store", {}).get("tiers", {})})
        for name in names:
            s = [r.get("store", {}).get("tiers", {}).get(name) for r in (pool, tiers)]
            t.add_row(f"{name} tier hit rate", *(fmt(x["hit_rate"], ".1%") if x else "-" for x in s), "")
            t.add_row(f"{name} loaded / saved (MiB)",
                      *(f"{x['loaded_bytes'] / MiB:.0f} / {x['saved_bytes'] / MiB:.0f}" if x else "-" for x in s), "")
            t.add_row(f"{name} load ms/block, evictions, verify fails",
                      *(f"{fmt(x['load_ms_per_block'], '.2f')}, {x['evictions']:.0f}, {x['verify_failures']:.0f}"
                        if x else "-" for x in s), "")
        reusable = results[part].get("reusable_share")
        if reusable is not None:
            t.add_row("reusable share of prompt tokens", f"{reusable:.1%}", "", "")
        out.append(t)
    probe = results.get("probe")
    if probe and probe.get("pool_ttft_median_ms") is not None:
        t = Table(title=f"one {probe['prompt_tokens']}-token prompt: TTFT median of {probe['reps']} "
                  f"({2 * probe['reps']} from the pool)")
        for col in ("served from", "TTFT (ms)", "x pool", "store load (ms)"):
            t.add_column(col, justify="left" if col == "served from" else "right")
        for kind, label in (("cold", "recompute (cold)"), ("pool", "own pool"), ("host", "host tier"),
                            ("disk", "disk tier (restarted server)")):
            t.add_row(label, fmt(probe[f"{kind}_ttft_median_ms"]),
                      "1.00" if kind == "pool" else fmt(probe.get(f"{kind}_over_pool"), ".2f"),
                      fmt(probe.get(f"{kind}_store_load_ms_median"), ".1f") if kind in ("host", "disk") else "")
        out.append(t)
    g = Table(title="goals")
    for col in ("goal", "value", "target", "met"):
        g.add_column(col)
    for name, row in results["goals"].items():
        met = {True: "[green]pass[/]", False: "[red]miss[/]", None: "-"}[row["met"]]
        g.add_row(name, fmt(row["value"], ".3f"), row["goal"], met)
    out.append(g)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"pool": "tab:red", "tiers": "tab:blue"}
    ax = axes[0]
    for config, run in results.get("multi_turn", {}).get("runs", {}).items():
        if "by_turn" not in run:
            continue
        turns = sorted(run["by_turn"], key=int)
        ax.plot([int(t) for t in turns], [run["by_turn"][t]["ttft_p50_ms"] for t in turns], marker="o",
                color=colors.get(config), label=f"{config} p50")
        ax.plot([int(t) for t in turns], [run["by_turn"][t]["ttft_p90_ms"] for t in turns], ls=":",
                color=colors.get(config), label=f"{config} p90")
    ax.set_xlabel(f"turn (the history grows ~{results['settings']['tokens_per_turn']} tokens a turn)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("multi-turn: TTFT by turn")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[1]
    for config, run in results.get("trace", {}).get("runs", {}).items():
        ttfts = sorted(1000 * r[2] for r in run.get("records", []))
        if ttfts:
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), color=colors.get(config), label=config)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the minor labels overlap
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Mooncake-trace replay: TTFT CDF")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[2]
    probe = results.get("probe", {})
    kinds = [("cold", "recompute"), ("pool", "own pool"), ("host", "host tier"), ("disk", "disk tier")]
    values = [probe.get(f"{k}_ttft_median_ms") or 0.0 for k, _ in kinds]
    ax.bar([label for _, label in kinds], values, color=["tab:gray", "tab:green", "tab:blue", "tab:purple"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("TTFT (ms), median")
    ax.set_title(f"one {probe.get('prompt_tokens', '?')}-token prompt, served from")
    fig.suptitle("tiered KV store vs the pool alone (colocated tandem serve)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
