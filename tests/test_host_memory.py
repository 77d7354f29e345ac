"""The KV pool's host memory: zeroed, aligned to huge pages, and actually backed by them where the
kernel allows it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tandem.kv.host_memory import HUGE_PAGE, huge_page_zeros, huge_pages_supported, prefault


def mapped_bytes(t: torch.Tensor, field: str) -> int:
    """A /proc/self/smaps field (e.g. "Rss:", "AnonHugePages:") summed over the mappings under t."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total = lo = hi = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
            elif head == field and lo < end and hi > start:
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
    assert mapped_bytes(t, "AnonHugePages:") >= 4 * HUGE_PAGE


def test_engine_pool_uses_it() -> None:
    from tandem.config import EngineConfig
    from tandem.engine.runner import allocate_kv_pool
    from tandem.model.arch import ArchConfig

    config = EngineConfig.from_kwargs("unused", dtype="float32", num_blocks=8, block_size=16, prefault_kv_cache=False)
    arch = ArchConfig("llama", 64, 64, 128, 2, 4, 2, 32, 1e-5, 1e4, 256, True)
    pool = allocate_kv_pool(config, arch, 8, torch.device("cpu")).local
    assert pool.shape == (2, 2, 8, 16, 2, 32)
    if huge_pages_supported():
        assert pool.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(pool) == 0


@pytest.mark.skipif(not huge_pages_supported(), reason="needs an anonymous mapping of its own")
def test_prefault_commits_every_page_and_keeps_zeros() -> None:
    t = huge_page_zeros((16 * HUGE_PAGE // 2,), torch.bfloat16)  # 16 MiB, committed lazily
    assert mapped_bytes(t, "Rss:") < 4 * HUGE_PAGE
    prefault(t)
    assert mapped_bytes(t, "Rss:") >= 16 * HUGE_PAGE
    assert torch.count_nonzero(t) == 0


@pytest.mark.skipif(not huge_pages_supported(), reason="needs an anonymous mapping of its own")
@pytest.mark.parametrize("on", [True, False])
def test_runner_prefaults_its_pool_unless_told_not_to(tmp_path: Path, on: bool) -> None:
    from test_tiny_models import build

    from tandem.config import EngineConfig
    from tandem.engine.core import EngineCore
    from tandem.model.loader import load_model

    path = build("llama", tmp_path)[0]
    config = EngineConfig.from_kwargs(str(path), dtype="float32", kv_cache_memory=0.0625, prefault_kv_cache=on)
    core = EngineCore(config, load_model(str(path), torch.float32).model)
    pool = core.runner.kv_caches
    size = pool.numel() * pool.itemsize
    resident = mapped_bytes(pool, "Rss:")
    assert resident >= size if on else resident < size // 2


@pytest.mark.parametrize("flag", [[], ["--no-prefault-kv-cache"]])
def test_prefault_flag_reaches_workers(flag: list[str]) -> None:
    # Disaggregated workers are started with engine_argv of the parent's flags: the choice must survive.
    import argparse

    from tandem.engine.args import add_engine_args, engine_argv, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-memory", "0.5", *flag])
    assert engine_kwargs(args)["prefault_kv_cache"] == (not flag)
    again = parser.parse_args(engine_argv(args))
    assert engine_kwargs(again) == engine_kwargs(args)
