"""Values given on a command line or in a setting, parsed with an error that names where they came from.

Torch-free, so that light clients (the benchmark client) can use it without the engine's settings.
"""

from __future__ import annotations

import json


def json_object(text: str, what: str) -> dict:
    """text as a JSON object, or a ValueError naming `what` (a flag, a setting)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value
