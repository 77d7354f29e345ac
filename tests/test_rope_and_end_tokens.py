"""RoPE scaling as checkpoints declare it, served greedily as transformers serves the same weights: Llama
3.1+'s (rope_type "llama3") from a Hugging Face directory and from a GGUF file as llama.cpp's converter
writes it (the scaling as the `rope_freqs` tensor, q/k rows in its interleaved order), and Qwen2.5's
YaRN from a GGUF file's rope.scaling metadata (from a directory: tests/test_tiny_models.py). And
generation ends on every end token a model declares (Llama 3.x Instruct declares three)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_hf_model
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem import SamplingParams

VOCAB = 96
# Its original context is short enough that the prompts' positions see all three kinds of rotary pair:
# kept (wavelength < 16), divided by the factor (> 64) and blended between.
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=SCALING, tie_word_embeddings=True)
    return random_hf_model(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("llama3") / "hf")


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows (each head's rotary halves interleaved), as its converter permutes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ref: torch.nn.Module, path: Path, end_tokens: tuple[int, int, int] | None = None,
               scaling: dict[str, object] | None = None) -> None:
    """The weights in llama.cpp's layout (llama, or qwen2 with its biases), float32. Llama 3's scaling
    as the frequency divisors that transformers' own llama3 initialiser implies (its default frequencies
    over its scaled ones); `scaling`: rope.scaling metadata instead (qwen2's YaRN); end_tokens: the
    tokenizer metadata's eos, eot and eom ids."""
    cfg = ref.config
    arch = "qwen2" if isinstance(ref, Qwen2ForCausalLM) else "llama"
    w = gguf.GGUFWriter(path, arch)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads, "vocab_size": VOCAB,
                       "rope.dimension_count": head_dim}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if end_tokens is not None:  # eos, end of turn, end of message
        w.add_eos_token_id(end_tokens[0])
        w.add_eot_token_id(end_tokens[1])
        w.add_eom_token_id(end_tokens[2])
    if scaling is not None:
        for key, value in scaling.items():
            (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
                f"{arch}.rope.scaling.{key}", value)
    elif arch == "llama":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        default = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        w.add_tensor("rope_freqs.weight", (default / scaled).float().numpy())
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in ref.state_dict().items():
        name, t = name.removeprefix("model."), t.float().numpy()
        if name in names:
            if name != "lm_head.weight" or not cfg.tie_word_embeddings:
                w.add_tensor(names[name], t)
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                t = interleave(t, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = interleave(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{layer[module]}.{kind}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_are_transformers_with_llama3_rope_scaling(source: str, model, tmp_path: Path,  # noqa: ANN001
                                                                  make_llm) -> None:  # noqa: ANN001
    path, ref = model
    if source == "gguf":
        path = tmp_path / "llama3.gguf"
        write_gguf(ref, path)
    llm = make_llm(model=str(path), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    arch = llm.engine.loaded.arch
    assert len(arch.rope_freq_factors) == 8 and max(arch.rope_freq_factors) == pytest.approx(8.0)
    gen = np.random.default_rng(3)
    prompts = [gen.integers(0, VOCAB, n).tolist() for n in (5, 40, 90)]  # past the original 64 positions
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 16)


def continuation(ref: torch.nn.Module, seed: int) -> tuple[list[int], list[int], int]:
    """A prompt, its 12 greedy tokens, and a position past the first where a token comes for the first
    time (to declare it an end token); prompts are drawn until one has it (a random model can repeat)."""
    gen = np.random.default_rng(seed)
    while True:
        prompt = gen.integers(0, VOCAB, 9).tolist()
        full = hf_greedy(ref, prompt, 12)
        cut = next((i for i in range(1, 12) if full[i] not in full[:i]), None)
        if cut is not None:
            return prompt, full, cut


def test_generation_stops_on_every_end_token_the_model_declares(model, tmp_path: Path,  # noqa: ANN001
                                                                make_llm) -> None:  # noqa: ANN001
    """config.json's eos list and generation_config.json's are merged, as Llama 3.x Instruct ships
    them ([128001, 128008, 128009]): the third id ends the generation; ignore_eos runs on."""
    path, ref = model
    prompt, full, cut = continuation(ref, 4)
    unused = [t for t in range(VOCAB) if t not in full][:2]
    d = tmp_path / "instruct"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": unused[0]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused[0], unused[1], full[cut]]}))
    llm = make_llm(model=str(d), dtype="float32", num_blocks=64, block_size=4)
    assert llm.engine.loaded.end_token_ids == (unused[0], unused[1], full[cut])
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out.outputs[0].token_ids == full[:cut + 1] and out.outputs[0].finish_reason == "stop"
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.outputs[0].token_ids == full


def test_a_gguf_files_end_of_turn_and_message_tokens_end_generation(model, tmp_path: Path,  # noqa: ANN001
                                                                     make_llm) -> None:  # noqa: ANN001
    path, ref = model
    prompt, full, cut = continuation(ref, 5)
    unused = [t for t in range(VOCAB) if t not in full][:2]
    gguf_path = tmp_path / "instruct.gguf"
    write_gguf(ref, gguf_path, (unused[0], unused[1], full[cut]))  # the end of a message (eom)
    llm = make_llm(model=str(gguf_path), dtype="float32", num_blocks=64, block_size=4)
    assert llm.engine.loaded.end_token_ids == (unused[0], unused[1], full[cut])
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out.outputs[0].token_ids == full[:cut + 1] and out.outputs[0].finish_reason == "stop"


def test_yarn_from_a_gguf_files_metadata_is_transformers(tmp_path: Path, make_llm) -> None:  # noqa: ANN001
    """Qwen2.5's YaRN as llama.cpp's converter writes it (rope.scaling.type, factor, original context)."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                      tie_word_embeddings=False)
    _, ref = random_hf_model(Qwen2ForCausalLM, cfg, tmp_path / "hf")
    path = tmp_path / "yarn.gguf"
    write_gguf(ref, path, scaling={"type": "yarn", "factor": 4.0, "original_context_length": 64})
    llm = make_llm(model=str(path), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.loaded.arch.rope_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    gen = np.random.default_rng(6)
    prompts = [gen.integers(0, VOCAB, n).tolist() for n in (5, 40, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 16)


def test_scalings_not_built_yet_are_refused_by_name() -> None:
    from tandem.model.rope import rope_from_hf

    for cfg, name in (({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "mrope"),
                      ({"partial_rotary_factor": 0.3}, "partial_rotary_factor")):
        with pytest.raises(NotImplementedError, match=name):
            rope_from_hf(cfg, 64)


@pytest.mark.parametrize("context", [64, 512])  # within the original context, and past it
def test_longrope_and_dynamic_ntk_are_transformers_at_the_deployments_context(context: int) -> None:
    """transformers computes these from the current sequence's length; a deployment fixes them from its
    context, so they must equal transformers' at a sequence of that length (long factors only past the
    original context; dynamic NTK's base raised only past max_position_embeddings)."""
    from tandem.model.rope import inv_freq, rope_from_hf

    phi = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                     original_max_position_embeddings=64, pad_token_id=0,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "original_max_position_embeddings": 64, "long_factor": [1.5, 2.0, 3.0, 5.0],
                                      "short_factor": [1.0, 1.1, 1.3, 1.6]})
    ours = rope_from_hf(phi.to_dict(), 16, context)
    expected, attention = ROPE_INIT_FUNCTIONS["longrope"](phi, "cpu", seq_len=context)
    assert ours.rotary_dim == 8
    torch.testing.assert_close(inv_freq(8, ours.theta) / torch.tensor(ours.freq_factors), expected)
    assert ours.attention_factor == pytest.approx(attention)
    assert ours.freq_factors == ((1.5, 2.0, 3.0, 5.0) if context > 64 else (1.0, 1.1, 1.3, 1.6))

    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                        rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ours = rope_from_hf(llama.to_dict(), 16, context)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](llama, "cpu", seq_len=context)
    torch.testing.assert_close(inv_freq(16, ours.theta), expected)
    assert (ours.theta > 10000.0) == (context > 128)
