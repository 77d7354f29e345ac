"""Host memory for the KV pool: zeroed, lazily committed, and backed by transparent huge pages.

Decode attention reads each sequence's blocks from wherever the block table points, so over a
pool of gigabytes nearly every block costs a TLB miss with 4 KiB pages (a bf16 block of this
model's K is 6 KiB). With 2 MiB pages the same reads ran 7-20% faster on the development machine
(bench/attention_op.py --compare-pages, both kinds of pool timed one after the other). Linux backs
an anonymous private mapping with huge pages when asked with madvise, even where the system-wide
policy is "madvise" (the common default); the pages are still only committed when first written,
so a large pool costs nothing until used, as with torch.zeros.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on memory advised for transparent huge pages, 2 MiB aligned.

    The tensor keeps its mapping alive; the memory goes back to the system when the tensor does.
    Falls back to torch.zeros where the platform has no such advice."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_supported() or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + nbytes].view(dtype).view(shape)

