"""Every model family from the GGUF file llama.cpp's own converter writes (tests/llama_cpp_converter.py)
from a tiny random Hugging Face model saved with the default model's tokenizer: Tandem, in float32, gives
transformers' greedy tokens on the same weights through chunked prefill, paged decode and a prefix-cache
hit. What each family reads from the file is its own: Llama 3's rope_freqs tensor, Qwen2.5's q/k/v biases and
YaRN's metadata,
Phi-3's fused tensors, longrope factors and partial rotary, SmolLM3's layers without RoPE, Granite's
multipliers, OLMo 2's norms after attention and MLP, gpt-oss's sinks, windows and experts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_hf_model
from llama_cpp_converter import convert, converter_available, declare_gpt2_tokenizer
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tandem import SamplingParams

# Set-up fetches the converter; only a machine that could not reach PyPI skips (never CI: it fails there).
pytestmark = pytest.mark.skipif(not converter_available() and not os.environ.get("CI"),
                                reason="llama.cpp's converter: run scripts/setup.sh test")

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-6)
# Longrope's original context is short, so that every prompt here is past it (transformers then takes the
# long factors, as a deployment of 2,048 tokens does); Phi-4-mini's partial rotary (12 of 16 dimensions).
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "original_max_position_embeddings": 32, "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 11.0],
             "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 1.9]}
FAMILIES = {
    "llama3": (LlamaForCausalLM, lambda v: LlamaConfig(
        **SHAPE, **v, tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # Qwen2.5 (q/k/v biases), with and without the YaRN that enables its long context, through llama.cpp's
    # Qwen2 converter (see SAVED_AS_LLAMA).
    "qwen2": (Qwen2ForCausalLM, lambda v: Qwen2Config(**SHAPE, **v, tie_word_embeddings=True)),
    "qwen2-yarn": (Qwen2ForCausalLM, lambda v: Qwen2Config(
        **SHAPE, **v, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    # YaRN with q/k/v and o biases through the Llama converter.
    "yarn-qkv-bias": (LlamaForCausalLM, lambda v: LlamaConfig(
        **SHAPE, **v, tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "phi3": (Phi3ForCausalLM, lambda v: Phi3Config(**SHAPE, **v, tie_word_embeddings=True, rope_parameters=PHI3_ROPE,
                                                   original_max_position_embeddings=32, pad_token_id=0)),
    "smollm3": (SmolLM3ForCausalLM, lambda v: SmolLM3Config(**{**SHAPE, "num_hidden_layers": 4}, **v,
                                                            tie_word_embeddings=True, pad_token_id=0)),
    "granite": (GraniteForCausalLM, lambda v: GraniteConfig(
        **SHAPE, **v, tie_word_embeddings=True, embedding_multiplier=3.0, attention_multiplier=0.1,
        residual_multiplier=0.5, logits_scaling=4.0)),
    "olmo2": (Olmo2ForCausalLM, lambda v: Olmo2Config(**SHAPE, **v, tie_word_embeddings=False, pad_token_id=0)),
    # Sinks, alternating sliding (8 keys) and global layers, YaRN without truncation (llama.cpp's file
    # does not say so: the family's rule), experts and router with biases; float experts (the MXFP4
    # ones are tests/test_gpt_oss.py's).
    "gpt-oss": (GptOssForCausalLM, lambda v: GptOssConfig(
        **{**SHAPE, "intermediate_size": 64}, **v, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})),
}


# A Qwen2 directory gets Qwen2's own pre-tokenizer from transformers' AutoTokenizer (by the config's
# model_type), which llama.cpp's converter does not recognise over the only vocabulary here (the default
# model's). Its config.json names model_type llama for the converter's tokenizer load only: the
# converter picks its Qwen2 class by `architectures` and writes a qwen2 file.
SAVED_AS_LLAMA = ("qwen2", "qwen2-yarn")
ARCHITECTURES = {"llama3": "llama", "qwen2-yarn": "qwen2", "yarn-qkv-bias": "llama"}  # the file's, where not the case's


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each family's directory (tokenizer included), its GGUF file from llama.cpp's converter, and
    the transformers model."""
    from tandem.model_path import default_model_path
    from tandem.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    assert tokenizer is not None
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    root = tmp_path_factory.mktemp("families")
    built = {}
    for name, (cls, config) in FAMILIES.items():
        path, ref = random_hf_model(cls, config(ids), root / name)
        tokenizer.save_pretrained(path)
        if name == "phi3":
            declare_gpt2_tokenizer(path)
        if name in SAVED_AS_LLAMA:
            config = path / "config.json"
            config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
        built[name] = (path, ref)
    files = convert([path for path, _ in built.values()])
    return {name: (gguf, ref) for (name, (_, ref)), gguf in zip(built.items(), files, strict=True)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_file_from_llama_cpps_converter_generates_transformers_tokens(
        family: str, families: dict[str, tuple[Path, torch.nn.Module]], make_llm) -> None:  # noqa: ANN001
    gguf, ref = families[family]
    llm = make_llm(model=str(gguf), dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=16)
    vocab = ref.config.vocab_size
    gen = np.random.default_rng(3)
    head = gen.integers(0, vocab, 41).tolist()
    prompts = [head + gen.integers(0, vocab, n).tolist() for n in (2, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)  # the shared head from the prefix cache
    assert all(o.metrics.num_cached_tokens >= 40 for o in rest), [o.metrics.num_cached_tokens for o in rest]
    assert llm.engine.core.runner.model.cfg.architecture == ARCHITECTURES.get(family, family)
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 10)
