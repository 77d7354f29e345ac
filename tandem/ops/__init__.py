"""Compiled CPU ops with pure-PyTorch fallbacks.

Re-exports are resolved lazily so that ``python -m tandem.ops.paged_attention`` (the build step)
does not import the module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["kernel_available", "load_kernel", "paged_decode_attention", "paged_decode_attention_torch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tandem.ops import paged_attention

        return getattr(paged_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
