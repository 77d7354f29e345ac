"""Where Tandem keeps what it derives once and reuses: built kernels, converted tokenizers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem")))
