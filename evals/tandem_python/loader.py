"""lm-eval's custom_dataset for tandem_python: the JSONL beside this file (no hub, no cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(**_: Any) -> Any:
    import datasets

    rows = [json.loads(line) for line in (Path(__file__).parent / "python_mc.jsonl").read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_zen(**_: Any) -> Any:
    """The Zen items as generation: the start of a line, and the rest of it to write."""
    import datasets

    rows = []
    for line in (Path(__file__).parent / "python_mc.jsonl").read_text().splitlines():
        item = json.loads(line)
        if item["context"].startswith("The Zen of Python"):
            start = item["context"].split("\n", 1)[1]
            rows.append({"start": start, "rest": item["choices"][item["label"]].strip()})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
