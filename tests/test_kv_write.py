"""Writing a step's new K/V into the pool: the compiled write_kv against index_copy_."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import extension
from tandem.ops import paged_attention as pa


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if not extension.extension_available():
        pytest.skip(f"compiled ops unavailable: {extension.extension_error() or 'disabled'}")


def _case(dtype: torch.dtype, tokens: int = 40, kvh: int = 3, d: int = 64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (3 + 2) * kvh * d, generator=g).to(dtype)  # q of 3 kv-head widths, then k, v
    k = qkv[:, 3 * kvh * d: 4 * kvh * d].view(tokens, kvh, d)
    v = qkv[:, 4 * kvh * d:].view(tokens, kvh, d)
    pool = torch.randn(2, 9, 16, kvh, d, generator=g).to(dtype)
    slots = torch.randperm(9 * 16, generator=g)[:tokens]
    return k, v, pool, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_index_copy(dtype: torch.dtype) -> None:
    k, v, pool, slots = _case(dtype)
    assert not k.is_contiguous()
    ref = pool.clone()
    ref[0].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    ref[1].view(-1, *k.shape[1:]).index_copy_(0, slots, v)
    pa.write_kv(k, v, pool[0], pool[1], slots)
    assert torch.equal(pool, ref)


def test_bad_slot_raises_and_writes_nothing() -> None:
    k, v, pool, slots = _case(torch.bfloat16)
    before = pool.clone()
    slots[-1] = 9 * 16  # one past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        pa.write_kv(k, v, pool[0], pool[1], slots)
    assert torch.equal(pool, before)
