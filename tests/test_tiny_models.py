"""Tiny random Llama (Llama 3's RoPE scaling too), Mistral (sliding window), Qwen2 (YaRN too), Qwen3,
Gemma 3, Phi-3 (longrope; Phi-4-mini's partial rotary), SmolLM3 (layers without RoPE), Granite (its
multipliers), OLMo 2 (norms after attention and MLP) and gpt-oss (sinks, alternating windows, its
mixture of experts) models built from configs: Tandem's logits match
transformers' within tolerance, through the packed prefill path and the paged decode path, on prompts
longer than the sliding windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_hf_model
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tandem import SamplingParams
from tandem.model.attention import build_attention_metadata
from tandem.model.held_weights import weight_formats
from tandem.model.loader import load_model

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=10000.0)),
    # Llama 3.1+'s RoPE scaling, its original context short enough that the test's positions see all
    # three kinds of pair: kept (wavelength < 16), divided by the factor (> 64) and blended between.
    "llama3-rope": (LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=10000.0,
                                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 64})),
    "llama-tied-mha": (LlamaForCausalLM, LlamaConfig(**{**COMMON, "num_key_value_heads": 4},
                                                      tie_word_embeddings=True)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False)),
    # YaRN (how Qwen2.5 reaches its long context): a ramp over the pairs, cos / sin scaled.
    "qwen2-yarn": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False,
                                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 64})),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)),
    "mistral-window": (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False)),
    # Sliding layers (window 8: the prompts run past it) around a global one, each with its RoPE base;
    # a score scale that is not head_dim's.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3-softcap": (Gemma3ForCausalLM, Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 2}, head_dim=32, sliding_window=6, final_logit_softcapping=3.0,
        layer_types=["full_attention", "sliding_attention"])),
    # Longrope with an original context of 4: cos / sin scaled by sqrt(1 + ln 128 / ln 4). The two lists
    # are equal here because transformers picks one by each sequence's own length (the short one up to 4
    # tokens) where a deployment fixes one; which one a deployment takes is tested in
    # test_rope_and_end_tokens.py and test_llama_cpp_families.py.
    "phi3-longrope": (Phi3ForCausalLM, Phi3Config(
        **COMMON, tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4,
                         "long_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 8.0],
                         "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 8.0]})),
    # Phi-4-mini's shape of RoPE: 12 of each head's 16 dimensions rotate; its original context is the
    # model's, so the short factors apply and nothing scales cos / sin.
    "phi4-partial": (Phi3ForCausalLM, Phi3Config(
        **COMMON, tie_word_embeddings=True, pad_token_id=0, original_max_position_embeddings=512,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 512, "long_factor": [2.0] * 6,
                         "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0]})),
    # Every fourth layer without RoPE.
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, tie_word_embeddings=True,
                                                  pad_token_id=0)),
    "granite": (GraniteForCausalLM, GraniteConfig(**COMMON, tie_word_embeddings=True, embedding_multiplier=3.0,
                                                  attention_multiplier=0.1, residual_multiplier=0.5,
                                                  logits_scaling=4.0)),
    "olmo2": (Olmo2ForCausalLM, Olmo2Config(**COMMON, tie_word_embeddings=False, pad_token_id=0)),
    # Sinks, sliding layers (window 8) alternating with global ones, YaRN without truncation, and a
    # mixture of experts with biases whose clamped SwiGLU clamps (limit 0.5 against pre-activations of
    # about 0.6).
    "gpt-oss": (GptOssForCausalLM, GptOssConfig(
        **{**COMMON, "intermediate_size": 32, "num_hidden_layers": 3}, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
}


def _strong_sinks(name: str, p: torch.Tensor) -> None:
    """Sink logits of either sign, large enough that some heads give most of their weight to the sink."""
    if name.endswith("self_attn.sinks"):
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 2)


ADJUST = {"gpt-oss": _strong_sinks}


def build(kind: str, root: Path) -> tuple[Path, torch.nn.Module]:
    cls, cfg = CASES[kind]
    return random_hf_model(cls, cfg, root / kind, ADJUST.get(kind))


@pytest.mark.parametrize("kernels", ["compiled", "pytorch"])
@pytest.mark.parametrize("kind", list(CASES))
def test_logits_match_transformers(kind: str, kernels: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels == "pytorch":  # every op's fallback: fused ops, decode and prefill attention
        monkeypatch.setenv("TANDEM_DISABLE_KERNELS", "1")
    path, ref = build(kind, tmp_path)
    loaded = load_model(str(path), torch.float32)  # quantization "gguf" by default: a directory stays dense
    assert loaded.tokenizer is None and weight_formats(loaded.model) == ("dense",)
    model, arch = loaded.model, loaded.arch
    block_size, num_blocks = 4, 64
    kv = torch.zeros(arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, COMMON["vocab_size"], n).tolist() for n in (5, 17, 1, 30)]
    # Scattered, non-contiguous blocks for each request.
    perm = gen.permutation(num_blocks)
    tables = np.stack([perm[i * 12:(i + 1) * 12] for i in range(len(prompts))]).astype(np.int32)

    def run(q_lens: list[int], ctx: list[int], ids: list[int], num_decodes: int, rows: list[int],
            sampled: list[int] | None = None) -> torch.Tensor:
        idx = np.arange(sum(q_lens)) if sampled is None else np.array(sampled)
        meta = build_attention_metadata(np.array(q_lens), np.array(ctx), tables[rows], num_decodes, block_size,
                                        torch.device("cpu"), idx)
        return model(torch.tensor(ids), meta, kv, torch.from_numpy(idx))

    # 1) Every prompt in one packed prefill batch (the 1-token prompt is a 'decode' row, first).
    order = [2, 0, 1, 3]
    logits = run([len(prompts[i]) for i in order], [0] * 4, sum((prompts[i] for i in order), []), 1, order)
    offset = 0
    with torch.inference_mode():
        for i in order:
            n = len(prompts[i])
            expected = ref(torch.tensor([prompts[i]])).logits[0]
            torch.testing.assert_close(logits[offset:offset + n], expected, atol=2e-4, rtol=2e-4)
            offset += n
        # 2) One decode token per request against the cached prompts (the paged decode path).
        nxt = [int(gen.integers(0, COMMON["vocab_size"])) for _ in order]
        logits = run([1] * 4, [len(prompts[i]) for i in order], nxt, 4, order)
        for row, i in enumerate(order):
            expected = ref(torch.tensor([prompts[i] + [nxt[row]]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4)
        # 3) One whole prompt alone: the causal fast path (no gather, no mask).
        logits = run([len(prompts[3])], [0], prompts[3], 0, [3])
        torch.testing.assert_close(logits, ref(torch.tensor([prompts[3]])).logits[0], atol=2e-4, rtol=2e-4)
        # 4) Logits for a few rows only (each prompt's last and one middle row): the last layer
        #    attends and runs its MLP for those rows alone, and the pool still gets every row's K/V.
        lens = [len(prompts[i]) for i in order]
        ends = np.cumsum(lens)
        sampled = [int(ends[-1]) - 5] + [int(e) - 1 for e in ends]
        kv.zero_()
        logits = run(lens, [0] * 4, sum((prompts[i] for i in order), []), 1, order, sampled)
        full = torch.cat([ref(torch.tensor([prompts[i]])).logits[0] for i in order])
        torch.testing.assert_close(logits, full[sampled], atol=2e-4, rtol=2e-4)
        nxt = [int(gen.integers(0, COMMON["vocab_size"])) for _ in order]
        logits = run([1] * 4, lens, nxt, 4, order)  # decodes over that pool
        for row, i in enumerate(order):
            expected = ref(torch.tensor([prompts[i] + [nxt[row]]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2-yarn", "qwen3", "mistral-window", "gemma3",
                                  "phi3-longrope", "phi4-partial", "smollm3", "granite", "olmo2", "gpt-oss"])
def test_engine_greedy_matches_transformers(kind: str, tmp_path: Path, make_llm) -> None:  # noqa: ANN001
    path, ref = build(kind, tmp_path)
    llm = make_llm(model=str(path), dtype="float32", num_blocks=40, block_size=4, max_num_batched_tokens=16)
    gen = np.random.default_rng(1)
    prompts = [gen.integers(0, COMMON["vocab_size"], n).tolist() for n in (3, 9, 40, 21)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    with torch.inference_mode():
        for p, out in zip(prompts, outs, strict=True):
            expected = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == expected
            assert out.outputs[0].text == ""  # no tokenizer in the directory


@pytest.mark.parametrize("kind", ["gemma3", "mistral-window", "gpt-oss"])
def test_sliding_window_with_prefix_caching(kind: str, tmp_path: Path, make_llm) -> None:  # noqa: ANN001
    """Prompts sharing a 25-token head (three windows of 8) come back from the prefix cache, in
    chunks of 6 tokens, and still generate what transformers generates: the cached blocks hold
    every layer's K/V, the windows reach back into them."""
    path, ref = build(kind, tmp_path)
    llm = make_llm(model=str(path), dtype="float32", num_blocks=60, block_size=4, max_num_batched_tokens=6)
    gen = np.random.default_rng(2)
    head = gen.integers(0, COMMON["vocab_size"], 25).tolist()
    prompts = [head + gen.integers(0, COMMON["vocab_size"], n).tolist() for n in (1, 7, 13)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert all(o.metrics.num_cached_tokens >= 24 for o in rest), [o.metrics.num_cached_tokens for o in rest]
    with torch.inference_mode():
        for p, out in zip(prompts, first + rest, strict=True):
            expected = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == expected


def test_a_checkpoint_tensor_nothing_reads_is_refused_by_name(tmp_path: Path) -> None:
    """A layout not built (here Llama's mlp_bias) is an error at load that names the tensors, never
    weights silently dropped."""
    from tandem.model_path import ModelLoadError

    path, _ = random_hf_model(LlamaForCausalLM, LlamaConfig(**COMMON, mlp_bias=True), tmp_path / "mlp-bias")
    with pytest.raises(ModelLoadError, match=r"does not use: \['layers\.0\.mlp\.down_proj\.bias'"):
        load_model(str(path), torch.float32)
