"""Which token-mask library is faster here: llguidance (Tandem's) or xgrammar (vLLM's default), on
the default model's tokenizer. For each grammar: the compile time of a fresh request's matcher (cold,
then warm, as the 2nd and 3rd requests with the same grammar would see it) and the time of every
mask along one valid output, token by token, with that output's tokens checked allowed by both.

xgrammar is not a Tandem dependency (its wheel requires triton); measure it from a side directory:

    .venv/bin/pip install --target /tmp/xg --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xg .venv/bin/python benchmarks/grammar_backends.py

Writes benchmarks/results/grammar_backends.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from structured_outputs import SCHEMA

from tandem.engine.grammars import Grammars
from tandem.engine.structured import disallowed_tokens
from tandem.model.loader import load_tokenizer
from tandem.sampling_params import StructuredOutputs

ROOT = Path(__file__).resolve().parent.parent
STORY = {"title": "The City at Night", "year": 1987, "scenes": [
    {"place": "a harbour in the rain", "mood": "tense", "lines": ["Who is there?", "Only the wind."]},
    {"place": "the old market square", "mood": "joyful", "lines": ["Bread! Fresh bread!", "Two, please."]}]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CASES = [  # (name, kind, spec, a valid output)
    ("story schema", "json", json.dumps(SCHEMA), json.dumps(STORY, indent=2)),
    ("flat schema", "json", json.dumps(PERSON), '{"name": "Ada Lovelace", "age": 36}'),
    ("regex", "regex", r"[A-Z][a-z]+ [0-9]{2}, [a-z]+@[a-z]+\.com", "Paris 75, info@paris.com"),
]
ROUNDS = 3


def time_path(fill: Any, accept: Any, ids: list[int], vocab: int) -> list[float]:
    per = []
    for token in ids:
        t = time.perf_counter()
        mask = fill()
        per.append(time.perf_counter() - t)
        if disallowed_tokens(mask, vocab)[0, token]:
            raise AssertionError(f"the mask forbids token {token} of a valid output")
        accept(token)
    return per


def llguidance_case(grammars: Grammars, kind: str, spec: str, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import llguidance.numpy as lln

    t = time.perf_counter()
    m = grammars.matcher(StructuredOutputs(kind, spec))
    compile_s = time.perf_counter() - t
    mask = lln.allocate_token_bitmask(1, vocab)

    def fill() -> Any:
        lln.fill_next_token_bitmask(m, mask, 0)
        return mask

    return compile_s, time_path(fill, lambda tok: m.consume_token(tok) or _bad(tok), ids, vocab)


def xgrammar_case(compiler: Any, kind: str, spec: str, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    t = time.perf_counter()
    compiled = (compiler.compile_json_schema(spec, any_whitespace=True) if kind == "json"
                else compiler.compile_regex(spec))
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, vocab)

    def fill() -> Any:
        m.fill_next_token_bitmask(mask, 0)
        return mask.numpy()

    return compile_s, time_path(fill, lambda tok: m.accept_token(tok) or _bad(tok), ids, vocab)


def _bad(token: int) -> None:
    raise AssertionError(f"token {token} of a valid output was refused")


def main() -> int:
    console = Console()
    tokenizer = load_tokenizer(None)
    vocab = 49152
    backends: dict[str, Any] = {}
    t = time.perf_counter()
    grammars = Grammars(tokenizer, vocab)
    grammars.ll  # noqa: B018 (built on first use)
    backends["llguidance"] = (lambda *a: llguidance_case(grammars, *a), time.perf_counter() - t)
    try:
        import xgrammar as xgr

        t = time.perf_counter()
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1)
        backends["xgrammar"] = (lambda *a: xgrammar_case(compiler, *a), time.perf_counter() - t)
    except ImportError:
        console.print("[yellow]xgrammar is not importable: measuring llguidance only (see the docstring)")
    table = Table(title="token-mask libraries: compile and per-token mask time, one thread")
    for col in ("grammar", "library", "tokens", "compile cold ms", "compile warm ms", "mask p50 us",
                "mask max ms", "masks total ms"):
        table.add_column(col, justify="right")
    results: dict[str, Any] = {name: {"tokenizer_s": setup} for name, (_, setup) in backends.items()}
    for case, kind, spec, text in CASES:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for name, (run, _) in backends.items():
            rounds = [run(kind, spec, ids, vocab) for _ in range(ROUNDS)]
            compiles = [c for c, _ in rounds]
            masks = [x for _, per in rounds[1:] for x in per]  # round 0 warms lazily built states
            row = {"tokens": len(ids), "compile_cold_ms": compiles[0] * 1e3,
                   "compile_warm_ms": statistics.mean(compiles[1:]) * 1e3,
                   "mask_p50_us": statistics.median(masks) * 1e6, "mask_max_ms": max(masks) * 1e3,
                   "masks_total_ms": sum(rounds[0][1]) * 1e3}
            results[name][case] = row
            table.add_row(case, name, str(len(ids)), f"{row['compile_cold_ms']:.1f}", f"{row['compile_warm_ms']:.1f}",
                          f"{row['mask_p50_us']:.0f}", f"{row['mask_max_ms']:.2f}", f"{row['masks_total_ms']:.1f}")
    console.print(table)
    console.print("tokenizer set-up: " + ", ".join(f"{n} {r['tokenizer_s']:.2f} s" for n, r in results.items()))
    out = ROOT / "benchmarks/results/grammar_backends.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
