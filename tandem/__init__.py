"""Tandem: LLM inference serving built around a paged KV cache."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# oneDNN caches a primitive per distinct problem shape (1,024 by default), and a step's row count
# changes nearly every step: bounded here, before torch creates its first primitive, so an engine's
# memory stays flat over a long soak instead of growing until the cache is full.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

from tandem.outputs import CompletionOutput, RequestOutput  # noqa: E402 (after the environment above)
from tandem.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from tandem.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM brings the engine and torch: loaded on first use, so that `import tandem.bench` (the
    # benchmark client) or `tandem --help` stays light.
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
