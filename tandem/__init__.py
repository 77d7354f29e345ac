"""Tandem: LLM inference serving built around a paged KV cache."""

import os

# oneDNN caches a primitive per distinct problem shape (1,024 by default), and a step's row count
# changes nearly every step: bounded here, before torch creates its first primitive, so an engine's
# memory stays flat over a long soak instead of growing until the cache is full.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

from tandem.llm import LLM  # noqa: E402 (after the environment above)
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
