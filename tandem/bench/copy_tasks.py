"""Copy-heavy prompts, the work speculative decoding is for: edit this code, summarise with quotes,
rewrite this JSON. Their material is what ships with Python: the standard library's own source,
its docstrings, and tables it holds (HTTP statuses), so the same seed gives the same prompts on
any machine with the same Python, and nothing is downloaded. workloads.py makes the requests; prompts are
sized with a token counter handed in, so this module needs nothing of the workloads.
"""

from __future__ import annotations

import ast
import http
import importlib
import inspect
import json
from collections.abc import Callable
from functools import cache

import numpy as np

COPY_TASKS = ("edit-code", "quote-summary", "rewrite-json")
_MODULES = ("textwrap", "json.encoder", "json.decoder", "shlex", "heapq", "bisect", "functools", "csv", "difflib",
            "argparse", "string", "fnmatch", "glob", "ipaddress", "statistics", "calendar", "gettext", "ntpath",
            "posixpath", "tokenize", "urllib.parse", "email.utils", "colorsys", "fractions", "base64")


@cache
def _functions() -> list[tuple[str, str]]:
    """(source, a parameter name to rename) of standard-library functions of 6 to 60 lines."""
    found = []
    for name in _MODULES:
        source = inspect.getsource(importlib.import_module(name))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno and 6 <= node.end_lineno - node.lineno <= 60:
                params = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 2]
                text = ast.get_source_segment(source, node)
                if params and text:
                    found.append((inspect.cleandoc("\n" + text) if text.startswith(" ") else text, params[0]))
    return found


@cache
def _docstrings() -> list[str]:
    """Module and function docstrings of at least 400 characters."""
    docs = []
    for name in _MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(getattr(module, n) for n in sorted(vars(module)) if not n.startswith("_"))]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj) \
                else None
            if doc and len(doc) >= 400 and doc not in docs:
                docs.append(doc)
    return docs


def _statuses() -> list[dict]:
    return [{"code": s.value, "phrase": s.phrase, "description": s.description} for s in http.HTTPStatus]


def _fit_lines(text: str, count: Callable[[str], int], budget: int) -> str:
    """Whole lines of text from the top, as many as fit in budget tokens (at least one)."""
    lines = text.splitlines()
    keep = len(lines)
    while keep > 1 and count("\n".join(lines[:keep])) > budget:
        keep = max(keep * 3 // 4, 1)
    return "\n".join(lines[:keep])


def copy_prompt(task: str, rng: np.random.Generator, count: Callable[[str], int], budget: int) -> str:
    """One prompt of task (one of COPY_TASKS) whose material fits in about budget tokens by count."""
    if task == "edit-code":
        functions = _functions()
        code, param = functions[int(rng.integers(len(functions)))]
        code = _fit_lines(code, count, budget)
        return (f"Rename the parameter `{param}` to `{param}_value` everywhere in this Python function and "
                f"return the whole function, otherwise unchanged:\n\n```python\n{code}\n```")
    if task == "quote-summary":
        docs = _docstrings()
        doc = _fit_lines(docs[int(rng.integers(len(docs)))], count, budget)
        return f"Summarise this documentation, quoting its key sentences word for word:\n\n{doc}"
    statuses = _statuses()
    start = int(rng.integers(len(statuses)))
    rows = [statuses[(start + i) % len(statuses)] for i in range(len(statuses))]
    data = _fit_lines(json.dumps(rows, indent=2), count, budget)
    if not data.rstrip().endswith("]"):  # cut at the last whole record
        data = data[:data.rfind("  }") + 3] + "\n]"
    return (f"Rewrite this JSON with every \"phrase\" in upper case, keeping everything else exactly as "
            f"it is:\n\n{data}")

