"""gpt-oss with its experts in MXFP4, as its checkpoints ship them: a tiny random model whose expert
stacks are random MXFP4 blocks, read from the HF directory (transformers' blocks and scales) and from the
GGUF file llama.cpp's converter writes from it, is served with the experts held as those blocks (never
dequantized at load) and gives the greedy tokens of transformers' forward on the same weights (which
dequantizes them) through chunked prefill, paged decode and a prefix-cache hit. Under expert parallelism
with EPLB, the experts' blocks and their biases move between ranks and the tokens stay the same.

The model's own arithmetic (sinks, windows, the clamped SwiGLU) is checked on logits in
tests/test_tiny_models.py, its float GGUF file in tests/test_llama_cpp_families.py, the MXFP4 kernels
against gguf-py in tests/test_kquants.py and tests/test_quant_linear.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, check_greedy_with_a_prefix_hit, hf_forward_greedy, random_hf_model
from llama_cpp_converter import convert, converter_available
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

from tandem import LLM, SamplingParams
from tandem.engine.core_report import core_stats
from tandem.model.block_formats import MXFP4
from tandem.model.linear import GGUFMethod

EXPERTS = 4
ENGINE = dict(dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=8)


def mxfp4_experts(directory: Path, skew: bool) -> None:
    """The saved checkpoint's expert stacks replaced by random MXFP4 blocks (scales 2^-8 to 2^-5, so the
    weights are of the float ones' size) and the config marked as transformers marks an MXFP4 checkpoint.
    skew: the router favours experts 0 and 1 (rank 0's under expert parallelism over two ranks)."""
    weights = load_file(directory / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in list(weights):
        if skew and name.endswith("mlp.router.weight"):
            weights[name][2:] *= 0.02
            weights[name][:2] *= 4.0
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, inputs, outputs = weights.pop(name).shape  # transformers holds them [experts, in, out]
        weights[f"{name}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                  generator=gen)
        weights[f"{name}_scales"] = torch.randint(119, 123, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                  generator=gen)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


def build(root: Path, skew: bool = False) -> tuple[Path, torch.nn.Module]:
    """The MXFP4 directory (with the default model's tokenizer, for the converter) and transformers'
    model of it, its experts dequantized (transformers' own CPU path for MXFP4)."""
    from tandem.model_path import default_model_path
    from tandem.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    assert tokenizer is not None
    cfg = GptOssConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                       num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 32,
                                        "rope_theta": 150000.0})
    path, _ = random_hf_model(GptOssForCausalLM, cfg, root / f"gpt-oss-mxfp4-{skew}")
    mxfp4_experts(path, skew)
    tokenizer.save_pretrained(path)
    ref = GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                            dtype=torch.float32).eval()
    return path, ref


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return build(tmp_path_factory.mktemp("gpt-oss"))


def check_greedy(llm: LLM, ref: torch.nn.Module) -> None:
    """Prompts past the window and the YaRN context, in chunks of 8; the last two share a 24-token head
    that the second finds cached."""
    check_greedy_with_a_prefix_hit(llm, ref, ref.config.vocab_size, (3, 19, 40))


def assert_experts_held_as_mxfp4(llm: LLM) -> None:
    for layer in llm.engine.core.runner.model.layers:
        moe = layer.mlp
        assert moe.method13 == GGUFMethod(MXFP4) and moe.method2 == GGUFMethod(MXFP4)
        assert moe.w13.dtype == torch.uint8 and moe.w2.dtype == torch.uint8
        assert moe.w13.shape[-1] == MXFP4.row_bytes(moe.hidden)  # 17 bytes a block of 32 weights


def test_an_mxfp4_checkpoint_is_served_as_stored(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """(The PyTorch fallbacks of the same arithmetic: the tiny-model logits test's pytorch case, and
    MXFP4's decoding against gguf-py in tests/test_kquants.py.)"""
    path, ref = checkpoint
    llm = LLM(str(path), **ENGINE)
    try:
        assert_experts_held_as_mxfp4(llm)
        check_greedy(llm, ref)
    finally:
        llm.close()


@pytest.mark.skipif(not converter_available() and not os.environ.get("CI"),
                    reason="llama.cpp's converter: run scripts/setup.sh test")
def test_the_mxfp4_gguf_file_from_llama_cpps_converter(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """The converter repacks the blocks into ggml's MXFP4 (nibbles reordered, the scale in front); served
    as stored, the weights held are the file's bytes (float32 elsewhere, as the file is)."""
    path, ref = checkpoint
    [file] = convert([path])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(file).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    llm = LLM(str(file), **ENGINE)
    try:
        assert_experts_held_as_mxfp4(llm)
        model = llm.engine.core.runner.model
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held <= 1.05 * file.stat().st_size
        check_greedy(llm, ref)
    finally:
        llm.close()


def test_expert_parallel_eplb_moves_mxfp4_experts_and_their_biases(tmp_path: Path) -> None:
    """Experts 0 and 1 (rank 0's) take most rows; with two spare slots a rank, EPLB places replicas of
    them on rank 1 every 4 steps: their blocks and biases cross in one all-to-all, and the tokens stay
    transformers'."""
    path, ref = build(tmp_path, skew=True)
    llm = LLM(str(path), tensor_parallel_size=1, expert_parallel_size=2, enable_eplb=True, eplb_spare_slots=2,
              eplb_interval=4, **{**ENGINE, "max_num_batched_tokens": 64})
    try:
        vocab = ref.config.vocab_size
        gen = np.random.default_rng(3)
        prompts = [gen.integers(0, vocab, 12).tolist() for _ in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_forward_greedy(ref, p, 16)
        assert core_stats(llm.engine.core).expert_rebalances > 0
        assert_pool_clean(llm.engine)
    finally:
        llm.close()


def test_a_gguf_file_ends_replies_on_harmonys_return_and_call_tokens() -> None:
    """Whatever eos the file declares, generation also stops at <|return|> and <|call|> (found by their
    text, as llama.cpp finds them)."""
    from tandem.model.gpt_oss import arch_from_gguf_metadata

    keys = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 64,
            "attention.head_count": 4, "attention.head_count_kv": 2, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 64, "attention.sliding_window": 128}
    tokens = [f"t{i}" for i in range(10)] + ["<|return|>", "<|endoftext|>", "<|call|>"]
    meta = {f"gpt-oss.{k}": v for k, v in keys.items()} | {"tokenizer.ggml.tokens": tokens,
                                                            "tokenizer.ggml.eos_token_id": 11}
    arch = arch_from_gguf_metadata(meta, True, True)
    assert arch.eos_token_ids == (11, 10, 12)
    assert arch.layer_windows == (128, 0) and arch.attn_sinks and arch.moe_bias and arch.swiglu_limit == 7.0
