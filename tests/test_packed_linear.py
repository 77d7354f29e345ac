"""Linear layers with oneDNN-packed weights compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.model.held_weights import held_forms, weight_bytes
from tandem.model.linear import DENSE, Embedding, Linear, PackedBf16Method
from tandem.model.packed_linear import (
    SMALL_BATCH_ROWS,
    PackedLinear,
    packing_supported,
    small_batch_supported,
)

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN weight packing unavailable")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_matches_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        torch.testing.assert_close(packed(x).float(), expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(packed(x.view(1, rows, 96)).float(), expected.view(1, rows, 160),
                                   atol=2e-2, rtol=2e-2)


def test_the_packed_method_computes_what_the_dense_one_does_and_drops_the_plain_weight() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    layers = []
    for method in (DENSE, PackedBf16Method()):
        layer = Linear(32, 64, True, torch.bfloat16, method)
        method.load(layer, [weight])
        layer.bias.data.copy_(bias)
        method.finish(layer)
        layers.append(layer)
    dense, packed = layers
    assert packed.weight is None and packed.packed is not None
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), dense(x).float(), atol=5e-2, rtol=5e-2)
    # Its bytes: the small-batch panels where built, oneDNN's copy (an opaque tensor) where the panels
    # do not serve every row, and the bias; each form by name.
    forms = held_forms(packed)
    held = {"packed-bf16 panels": packed.packed.panels, "packed-bf16 oneDNN": packed.packed.packed_weight}
    assert {f for f, t in held.items() if t is not None} | {"packed-bf16"} == set(forms)
    assert all(forms[f] == 64 * 32 * 2 for f, t in held.items() if t is not None)
    assert forms["packed-bf16"] == 64 * 2  # the bias
    assert weight_bytes(packed) == sum(forms.values())
    assert held_forms(dense) == {"dense": 64 * 32 * 2 + 64 * 2}


small_batch = pytest.mark.skipif(not small_batch_supported(), reason="small_batch_linear needs AVX512-BF16")


@small_batch
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("out_features", [150, 64])
def test_small_batch_linear_matches_float_reference(bias: bool, rows: int, out_features: int) -> None:
    # out_features 150: the last 32-column panel is partly padding, which must not reach the output.
    # A few rows take the dpbf16 path (1-2 on AMX; 1-16 elsewhere, 9-16 in two passes), more the
    # brgemm one (33, 100: on AMX the last, partial 32 rows from the zero-padded tail).
    torch.manual_seed(rows * out_features)
    linear = nn.Linear(96, out_features, bias=bias, dtype=torch.bfloat16)
    panels = torch.ops.tandem.pack_linear_weight(linear.weight)
    wide = torch.randn(rows, 200, dtype=torch.bfloat16)
    x = wide[:, 10:106]  # rows 200 apart: read in place
    with torch.inference_mode():
        got = torch.ops.tandem.small_batch_linear(x, panels, linear.bias, out_features)
        expected = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0.0)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        # fp32 accumulation rounded once to bf16: within one bf16 rounding of the exact result.
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=8e-3)
        onednn = onednn_linear(x.contiguous(), linear)
        assert (got.float() - onednn.float()).abs().max() <= 2 * (onednn.float().abs().max() * 2**-8)


def onednn_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 256)
    return torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")


@small_batch
def test_packed_linear_keeps_one_copy_where_the_panels_serve_every_row() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    assert packed.panels is not None
    # oneDNN's copy only where it serves the rows past the panels' (AMX).
    assert (packed.packed_weight is None) == (SMALL_BATCH_ROWS is None)
    x = torch.randn(300, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = onednn_linear(x, linear)
        for r in (1, 2, 8, 9, 16, 31, 32, 33, 64, 300):  # either side of every switch
            torch.testing.assert_close(packed(x[:r]).float(), reference[:r].float(), atol=2e-2, rtol=2e-2)


@small_batch
def test_small_batch_linear_rejects_a_mismatched_weight() -> None:
    panels = torch.ops.tandem.pack_linear_weight(torch.randn(64, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.tandem.small_batch_linear(torch.randn(1, 48, dtype=torch.bfloat16), panels, None, 64)
    with pytest.raises(RuntimeError, match="in_features must be even"):
        torch.ops.tandem.pack_linear_weight(torch.randn(8, 33, dtype=torch.bfloat16))


@small_batch
def test_a_tied_embedding_reads_its_rows_from_the_heads_panels() -> None:
    torch.manual_seed(0)
    weight = torch.randn(100, 64, dtype=torch.bfloat16)  # 100 rows: the last panel is partly padding
    embedding = Embedding(100, 64, torch.bfloat16)
    embedding.table.weight.data.copy_(weight)
    head = Linear(64, 100, False, torch.bfloat16, PackedBf16Method())
    head.method.load(head, [weight])
    head.method.finish(head)
    ids = torch.tensor([[0, 31, 32, 99], [63, 64, 5, 96]])
    with torch.inference_mode():
        expected = embedding(ids)
        embedding.share_head(head)
        assert embedding.table.weight is None  # one copy: the head's
        assert torch.equal(embedding(ids), expected) and torch.equal(expected, weight[ids])
    assert held_forms(nn.ModuleList([embedding, head])) == {"packed-bf16 panels": 4 * 32 * 64 * 2}
