"""One-stream TPOT against model size, Tandem beside llama-server: the plot docs/benchmarks.md shows
(issues #46, #47). Each run is a `benchmarks/vs_llama_cpp.py --workloads one-stream` result directory
on one GGUF file (made by benchmarks/model_shapes.py), given as LABEL=FILE=RESULT_DIR:

    .venv/bin/python benchmarks/tpot_by_size.py \\
        "Llama-3.2-1B=~/.cache/tandem/models/llama-3.2-1b-shape-Q4_K_M.gguf=benchmarks/results/sizes/1b" ...

The x axis is the file's bytes, the y axis each server's median TPOT; a table goes to stdout and the plot to
--out (default docs/tpot_by_size.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = {"tandem-auto": "Tandem (auto)", "llama.cpp": "llama-server"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=GGUF_FILE=RESULT_DIR")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/tpot_by_size.png")
    ap.add_argument("--machine", default="", help="named in the title")
    args = ap.parse_args()
    points: dict[str, list[tuple[float, float, str]]] = {s: [] for s in SERVERS}
    print(f"{'model':<16} {'file GB':>8} " + " ".join(f"{SERVERS[s]:>16}" for s in SERVERS) + "   ratio")
    for run in args.runs:
        label, file, result = run.split("=")
        size = Path(file).expanduser().stat().st_size / 1e9
        rows = {r["server"]: r for r in json.loads((Path(result) / "summary.json").read_text())
                if r["workload"] == "one-stream"}
        tpots = {s: rows[s]["median_tpot_ms"] for s in SERVERS if s in rows}
        for s, t in tpots.items():
            points[s].append((size, t, label))
        ratio = tpots["tandem-auto"] / tpots["llama.cpp"] if len(tpots) == 2 else float("nan")
        print(f"{label:<16} {size:>8.2f} " + " ".join(f"{tpots.get(s, float('nan')):>13.1f} ms" for s in SERVERS)
              + f"   {ratio:.2f}x")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s, pts in points.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=SERVERS[s])
        if s == "llama.cpp":
            for x, y, label in pts:
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("GGUF file (Q4_K_M), GB")
    ax.set_ylabel("one-stream TPOT p50, ms")
    ax.set_title("Decode time per token against model size" + (f" ({args.machine})" if args.machine else ""))
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
