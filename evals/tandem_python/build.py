"""Build python_mc.jsonl, the multiple-choice task that ships with Tandem, from text that ships with
Python itself: the Zen of Python (`this`) and the first sentences of the builtins' docstrings.
Each item: a context, four continuations (one right, three taken from other items by a fixed seed)
and the right one's index. Run once; the file is committed so every run scores the same items.

    .venv/bin/python evals/tandem_python/build.py
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import io
import json
import random
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def zen_items() -> list[tuple[str, str]]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    lines = [ln for ln in codecs.decode(this.s, "rot13").splitlines()[2:] if ln.strip()]
    items = []
    for line in lines:
        words = line.split(" ")
        cut = max(len(words) // 2, 1)
        items.append(("The Zen of Python, by Tim Peters:\n" + " ".join(words[:cut]), " " + " ".join(words[cut:])))
    return items


def builtin_items() -> list[tuple[str, str]]:
    items = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        # Functions only: not classes, nor the objects site adds (help, license, exit).
        if name.startswith("_") or not isinstance(obj, types.BuiltinFunctionType) or not obj.__doc__:
            continue
        doc = " ".join(obj.__doc__.split("\n\n")[0].split())
        if "(" in doc.split(" ")[0] or len(doc) > 120 or "." not in doc:
            continue  # a signature line, or too long to be one sentence
        items.append((f"Python's built-in function {name}():", " " + doc.split(". ")[0].rstrip(".") + "."))
    return items


def main() -> None:
    rng = random.Random(0)
    rows = []
    for group in (zen_items(), builtin_items()):
        endings = [e for _, e in group]
        for context, right in group:
            wrong = rng.sample([e for e in endings if e != right], 3)
            choices = [right, *wrong]
            rng.shuffle(choices)
            rows.append({"context": context, "choices": choices, "label": choices.index(right)})
    out = HERE / "python_mc.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} items -> {out}")


if __name__ == "__main__":
    main()
