"""Values given on a command line or in a setting, parsed with an error that names where they came from,
and the declaration that makes a settings field a flag.

Torch-free, so that light clients (the benchmark client) can use it without the engine's settings.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from typing import Any


def json_object(text: str, what: str) -> dict:
    """text as a JSON object, or a ValueError naming `what` (a flag, a setting)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value


@dataclass(frozen=True)
class Flag:
    """How a settings dataclass's field is a command-line flag: the one declaration the parser, a
    worker's command line, the offline keyword arguments and the docs' flag table are built from
    (engine/args.py)."""

    help: str = ""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None  # the title of the argument group it is listed under (None: the command's own)
    short: str | None = None  # another spelling, e.g. "-tp"
    name: str | None = None  # the flag's name and keyword, if not the field's (speculative -> speculative_config)
    # The flag's default is None, so the setting keeps its own (computed, or derived from another): doc
    # says what that is in the docs' table ("usable cores", "from memory").
    unset: str | None = None
    positional: bool = False  # the command's optional positional argument (the model)


def flag(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, **how: Any) -> Any:  # noqa: A002
    """A dataclass field that is also a flag (Flag's fields as keywords)."""
    return field(default=default, default_factory=default_factory, metadata={"flag": Flag(help, **how)})
