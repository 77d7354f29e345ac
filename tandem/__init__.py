"""Tandem: LLM inference serving built around a paged KV cache."""

from tandem.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
