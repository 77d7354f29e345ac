"""Linear layers with oneDNN-packed weights compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.model.packed_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN weight packing unavailable")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_matches_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        torch.testing.assert_close(packed(x).float(), expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(packed(x.view(1, rows, 96)).float(), expected.view(1, rows, 160),
                                   atol=2e-2, rtol=2e-2)


def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(50, 32, dtype=torch.bfloat16)
    model.block = nn.Sequential(nn.Linear(32, 64, dtype=torch.bfloat16), nn.Linear(64, 32, dtype=torch.bfloat16))
    model.head = nn.Linear(32, 50, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.embed.weight
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = model.head(model.block(x)).float()
        assert pack_linears(model) == 3
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        torch.testing.assert_close(model.head(model.block(x)).float(), before, atol=5e-2, rtol=5e-2)
    assert model.embed.weight.shape == (50, 32)  # the embedding a tied head shared is untouched
