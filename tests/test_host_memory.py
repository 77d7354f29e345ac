"""The KV pool's host memory: zeroed, aligned to huge pages, and actually backed by them where the
kernel allows it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tandem.kv.host_memory import HUGE_PAGE, huge_page_zeros, huge_pages_supported


def huge_page_bytes(t: torch.Tensor) -> int:
    """How many bytes of the mappings under t the kernel backs with huge pages now (/proc/self/smaps)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total = lo = hi = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
            elif head == "AnonHugePages:" and lo < end and hi > start:
                total += int(line.split()[1]) * 1024
    return total


def _thp_allowed() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (2, 2, 37, 16, 3, 64)
    t = huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    if huge_pages_supported():
        assert t.data_ptr() % HUGE_PAGE == 0
    t[1, 0, 5] = 3.0
    assert float(t.sum()) == 3.0 * 16 * 3 * 64


def test_memory_outlives_the_name_of_its_mapping() -> None:
    # Only views of the mapping are returned; they must keep it alive on their own.
    t = huge_page_zeros((1024, 1024), torch.float32)[10:20]
    gc.collect()
    t.fill_(7.0)
    assert float(t.sum()) == 7.0 * 10 * 1024


@pytest.mark.skipif(not (huge_pages_supported() and _thp_allowed()), reason="transparent huge pages are off here")
def test_pool_is_backed_by_huge_pages_once_written() -> None:
    t = huge_page_zeros((8 * HUGE_PAGE // 4,), torch.float32)
    t.fill_(1.0)
    assert huge_page_bytes(t) >= 4 * HUGE_PAGE


def test_engine_pool_uses_it() -> None:
    from tandem.engine.runner import default_kv_allocator

    pool = default_kv_allocator((2, 2, 8, 16, 2, 32), torch.float32, torch.device("cpu"))
    if huge_pages_supported():
        assert pool.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(pool) == 0
