"""What a JSON schema costs a stream, side by side in one run: one `tandem serve`, the same `tandem
bench serve` load with and without `response_format` (a JSON schema), at concurrency 1 and 32,
alternating, fresh prompts every run. Outputs are held to the same length (`--ignore-eos`: once the
JSON is complete the mask allows only end-of-sequence), so output tokens/s compare like for like.

Prints output tokens/s and TPOT per condition and the ratio to unconstrained; writes
benchmarks/results/structured/summary.json. Goal: at most 5% slower at c32 and 10% at c1.

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --rounds 3 --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from server_process import add_server_args, bench_serve, serving, tandem_exe

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "scenes": {"type": "array", "items": {"type": "object", "properties": {
        "place": {"type": "string"}, "mood": {"enum": ["calm", "tense", "joyful", "sad"]},
        "lines": {"type": "array", "items": {"type": "string"}}}, "required": ["place", "mood", "lines"]}}},
    "required": ["title", "year", "scenes"]}
BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    add_server_args(ap, ROOT / "benchmarks/results/structured", "WARNING")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[tuple[int, str], list[dict]] = {(c, m): [] for c in levels for m in ("free", "schema")}
    seed = 2000
    with Progress(console=console, transient=True) as progress, serving("structured", [], args, progress) as server:
        # Not measured: the first constrained request builds llguidance's view of the vocabulary
        # (half a second, once per process), in the API process and in the engine core.
        bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--backend", "openai-chat",
                     "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
                     "--num-prompts", "2", "--disable-tqdm", "--extra-body", json.dumps(BODY)],
                    args.out_dir / "client.log", progress, "warm-up")
        for r in range(args.rounds):
            for c in levels:
                for mode in (("free", "schema") if r % 2 == 0 else ("schema", "free")):
                    seed += 1
                    out = args.out_dir / f"{mode}-c{c}-{r}.json"
                    extra = ["--extra-body", json.dumps(BODY)] if mode == "schema" else []
                    bench_serve([tandem_exe(), "bench", "serve", "--base-url", server.url, "--backend", "openai-chat",
                                 "--dataset-name", "random", "--random-input-len", "128", "--random-output-len",
                                 str(args.output_len), "--ignore-eos", "--max-concurrency", str(c),
                                 "--num-prompts", str(max(c * args.prompts_per_stream, 4)), "--seed", str(seed),
                                 "--disable-tqdm", "--save-result", "--result-dir", str(args.out_dir),
                                 "--result-filename", out.name, *extra],
                                args.out_dir / "client.log", progress, f"round {r + 1}: c{c} {mode}")
                    result = json.loads(out.read_text())
                    runs[(c, mode)].append(result)
                    console.print(f"round {r + 1} c{c} {mode}: {result['output_throughput']:.1f} tok/s, "
                                  f"TPOT {result['median_tpot_ms']:.1f} ms, {result['failed']} failed")
    table = Table(title=f"structured outputs: JSON schema vs none, {args.rounds} rounds")
    for col in ("concurrency", "free tok/s", "schema tok/s", "schema / free", "free TPOT ms", "schema TPOT ms"):
        table.add_column(col, justify="right")
    summary: dict = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "levels": {}}
    for c in levels:
        free = statistics.mean(x["output_throughput"] for x in runs[(c, "free")])
        schema = statistics.mean(x["output_throughput"] for x in runs[(c, "schema")])
        tpot = {m: statistics.mean(x["median_tpot_ms"] for x in runs[(c, m)]) for m in ("free", "schema")}
        summary["levels"][c] = {"free": free, "schema": schema, "ratio": schema / free, "tpot_ms": tpot}
        table.add_row(str(c), f"{free:.1f}", f"{schema:.1f}", f"{schema / free:.3f}", f"{tpot['free']:.1f}",
                      f"{tpot['schema']:.1f}")
    console.print(table)
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
