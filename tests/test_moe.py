"""Mixture of experts (Qwen3-MoE layout): a tiny random model from a config equals transformers token
for token under greedy float32, read from a HF directory and from a GGUF file, alone, with tensor
parallelism (each expert split) and with expert parallelism (all-to-all dispatch), with chunked
prefill and prefix-cache hits; EPLB's rebalanced placement serves the same tokens and evens the
ranks' load on a skewed router."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, check_greedy_with_a_prefix_hit, hf_forward_greedy, random_hf_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.core_report import core_stats
from tandem.model.eplb import initial_placement, rank_loads, rebalance, replica_table

VOCAB = 96


def build(root: Path, norm_topk: bool = True, skew: bool = False,
          dense_first: bool = True) -> tuple[Path, torch.nn.Module]:
    """8 experts, top 2, layer 0 dense (mlp_only_layers) if dense_first (llama.cpp's qwen3moe has every
    layer sparse). skew: the router favours experts 0-3 (rank 0's under expert parallelism over 2 ranks)."""
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0] if dense_first else [],
                         max_position_embeddings=256, tie_word_embeddings=False, norm_topk_prob=norm_topk)

    def skewed(name: str, p: torch.Tensor) -> None:
        if skew and name.endswith("mlp.gate.weight"):
            p[4:] *= 0.02
            p[:4] *= 4.0

    return random_hf_model(Qwen3MoeForCausalLM, cfg, root / f"qwen3moe-{norm_topk}-{skew}-{dense_first}", skewed)


def write_gguf(model: torch.nn.Module, path: Path) -> None:
    """llama.cpp's qwen3moe layout, float32 tensors: stacked experts [experts, out, in]."""
    cfg = model.config
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
                       "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                       "expert_feed_forward_length": cfg.moe_intermediate_size, "vocab_size": VOCAB}.items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    sd = {k.removeprefix("model."): v.float().numpy() for k, v in model.state_dict().items()}
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    for name, t in sd.items():
        if name in names:
            w.add_tensor(names[name], t)
            continue
        _, i, rest = name.split(".", 2)
        module = rest.removesuffix(".weight")
        if module in layer:
            w.add_tensor(f"blk.{i}.{layer[module]}.weight", t)
    for i in range(cfg.num_hidden_layers):
        gate_up = sd[f"layers.{i}.mlp.experts.gate_up_proj"]  # transformers holds them fused in memory
        half = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :half]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, half:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"layers.{i}.mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_greedy(llm: LLM, ref: torch.nn.Module) -> None:
    """Prompts in chunks of 8 tokens; the last two share a 24-token head that the second finds cached."""
    check_greedy_with_a_prefix_hit(llm, ref, VOCAB, (3, 9, 30))


ENGINE = dict(dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=8)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_greedy_matches_transformers(norm_topk: bool, tmp_path: Path) -> None:
    path, ref = build(tmp_path, norm_topk)
    llm = LLM(str(path), **ENGINE)
    try:
        model = llm.engine.core.runner.model
        assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.cfg.sparse_layers == (1, 2)
        check_greedy(llm, ref)
    finally:
        llm.close()


def test_moe_from_gguf_matches_transformers(tmp_path: Path) -> None:
    _, ref = build(tmp_path, dense_first=False)
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(ref, path)
    llm = LLM(str(path), **ENGINE)
    try:
        assert llm.engine.core.runner.model.cfg.num_experts == 8
        check_greedy(llm, ref)
    finally:
        llm.close()


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (1, 2)])
def test_moe_parallel_greedy_matches_transformers(tp: int, ep: int, tmp_path: Path) -> None:
    """tp 2: each expert split over the ranks; ep 2: experts 0-3 on rank 0, 4-7 on rank 1 (attention split
    with tp 2, whole on both ranks with tp 1)."""
    path, ref = build(tmp_path)
    llm = LLM(str(path), tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE)
    try:
        check_greedy(llm, ref)
    finally:
        llm.close()


def test_eplb_placement() -> None:
    assert initial_placement(8, 2, 5) == [0, 1, 2, 3, -1, 4, 5, 6, 7, -1]
    loads = [40.0, 30.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0]
    before = rank_loads(initial_placement(8, 2, 5), loads, 2, 5)
    placement = rebalance(loads, 2, 5)
    after = rank_loads(placement, loads, 2, 5)
    assert sorted(e for e in placement if e >= 0) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]  # the two hottest replicated
    assert max(before) / (sum(before) / 2) > 1.8 and max(after) / (sum(after) / 2) < 1.05
    table, count = replica_table(placement, 8)
    assert count.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert all(placement[s] == e for e in range(8) for s in table[e].tolist())


@pytest.mark.parametrize("eplb", [False, True])
def test_eplb_evens_a_skewed_router(eplb: bool, tmp_path: Path) -> None:
    """Experts 0-3 (rank 0's) take most rows: without EPLB rank 0 computes most of them; with two spare
    slots a rank, replicas of the hot experts on rank 1 bring max / mean rows per rank to at most 1.3,
    rebalanced every 4 steps while the streams go on, and the tokens stay transformers'."""
    path, ref = build(tmp_path, skew=True)
    llm = LLM(str(path), tensor_parallel_size=1, expert_parallel_size=2, enable_eplb=eplb, eplb_spare_slots=2,
              eplb_interval=4, **{**ENGINE, "max_num_batched_tokens": 64})
    try:
        gen = np.random.default_rng(3)
        prompts = [gen.integers(0, VOCAB, 12).tolist() for _ in range(8)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_forward_greedy(ref, p, 24)
        core = llm.engine.core
        loads = core.runner.model.expert_loads()
        stats = core_stats(core)  # what the server's metrics show (tandem:expert_load_imbalance)
        assert stats.expert_imbalance == [load.imbalance for load in loads]
        assert (stats.expert_rebalances > 0) == eplb
        assert len(loads) == 2 and all(sum(load.per_rank) > 0 for load in loads)
        imbalance = max(load.imbalance for load in loads)
        if eplb:
            assert imbalance <= 1.3
            assert llm.engine.core.runner.model.layers[1].mlp.num_replicas.max() > 1  # hot experts replicated
        else:
            assert imbalance > 1.5
        assert_pool_clean(llm.engine)
    finally:
        llm.close()
