"""Do strict JSON-schema replies finish (issue #33)? One `tandem serve` (the default model), small object
schemas that do not say additionalProperties, `strict: true`, temperature 0.8, max_tokens 120, many
seeds each; per condition, the fraction of replies that parse as an object, of those valid under the
closed schema (what strict promises), of those cut by max_tokens (finish_reason length), and the mean
completion tokens. Conditions: compact whitespace (the default), flexible (`structured_outputs.disable_any_whitespace:
false`), and the schema left open (`strict: false`) with flexible whitespace, as before the fix.

Writes benchmarks/results/structured_finish/summary.json.

    .venv/bin/python benchmarks/structured_finish.py
    .venv/bin/python benchmarks/structured_finish.py --seeds 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from server_process import add_server_args, serving

from tandem.engine.grammars import closed_objects

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
# (prompt, schema): held out of the tests' schemas; none says additionalProperties.
CASES = [
    ("Describe a person as JSON.", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}),
    ("A city you like, as JSON.", {"type": "object", "properties": {
        "name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}),
    ("A book, as JSON.", {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["last"]}}, "required": ["title", "year", "author"]}),
]
CONDITIONS: dict[str, dict[str, Any]] = {
    "strict, compact (default)": {"strict": True, "extra": {}},
    "strict, flexible": {"strict": True, "extra": {"structured_outputs": {"disable_any_whitespace": False}}},
    "open, flexible (before)": {"strict": False, "extra": {"structured_outputs": {"disable_any_whitespace": False}}},
}


async def one(client: httpx.AsyncClient, url: str, prompt: str, schema: dict, strict: bool, extra: dict,
              seed: int, max_tokens: int, seats: asyncio.Semaphore) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0.8, "seed": seed,
            "max_tokens": max_tokens, "response_format": {"type": "json_schema", "json_schema": {
                "name": "reply", "strict": strict, "schema": schema}}, **extra}
    async with seats:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    reply = r.json()
    text = reply["choices"][0]["message"]["content"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    try:
        jsonschema.validate(value, closed_objects(schema))
        valid = True
    except jsonschema.ValidationError:
        valid = False
    return {"object": isinstance(value, dict), "valid": valid, "reason": reply["choices"][0]["finish_reason"],
            "tokens": reply["usage"]["completion_tokens"], "newlines": text.count("\n")}


async def measure(url: str, seeds: int, max_tokens: int, concurrency: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    seats = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        for name, cond in CONDITIONS.items():
            results[name] = await asyncio.gather(*(
                one(client, url, prompt, schema, cond["strict"], cond["extra"], seed, max_tokens, seats)
                for prompt, schema in CASES for seed in range(seeds)))
            console.print(f"{name}: done")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16, help="requests per schema and condition")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
    add_server_args(ap, ROOT / "benchmarks/results/structured_finish", "WARNING")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # What replies say is measured, not how fast: every request is admitted, whatever its deadline.
    with Progress(console=console, transient=True) as progress, serving("structured-finish", ["--admission", "off"],
                                                                         args, progress) as server:
        results = asyncio.run(measure(server.url, args.seeds, args.max_tokens, args.concurrency))
    table = Table(title=f"JSON schemas: {len(CASES)} schemas x {args.seeds} seeds, temperature 0.8, "
                        f"max_tokens {args.max_tokens}")
    for col in ("condition", "objects", "valid (closed)", "finish length", "mean tokens", "mean newlines"):
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "conditions": {}}
    for name, rows in results.items():
        row = {"object": statistics.mean(r["object"] for r in rows), "valid": statistics.mean(r["valid"] for r in rows),
               "length": statistics.mean(r["reason"] == "length" for r in rows),
               "tokens": statistics.mean(r["tokens"] for r in rows),
               "newlines": statistics.mean(r["newlines"] for r in rows), "n": len(rows)}
        summary["conditions"][name] = row
        table.add_row(name, *(f"{row[k]:.2f}" for k in ("object", "valid", "length")), f"{row['tokens']:.1f}",
                      f"{row['newlines']:.1f}")
    console.print(table)
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
