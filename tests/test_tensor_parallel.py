"""Tensor parallelism: one model across two processes (engine/worker_group.py; every layer split, and
the vocabulary: embedding and head rows by token id) equals transformers
token for token under greedy float32, with chunked prefill, prefix-cache hits and speculative
decoding; the shard plan splits heads as documented; the collectives agree over shared memory and gloo."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, hf_greedy, random_hf_model
from server_utils import children, cmdline, running_server, web
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tandem import LLM, SamplingParams
from tandem.model.arch import ArchConfig
from tandem.model.tensor_parallel import Shard, head_ranges, shard_arch, split_range
from tandem.parallel.shm import GroupFailed

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
CASES = {
    # 3 KV heads over 2 ranks, as the default model's: 2 and 1.
    "llama-uneven": (LlamaForCausalLM, LlamaConfig(**{**COMMON, "hidden_size": 96}, num_attention_heads=6,
                                                   num_key_value_heads=3)),
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # One KV head: both ranks hold it, each with half the query heads; sliding layers around a global one;
    # the head tied to the embedding (both split by token id).
    "gemma3-one-kv-head": (Gemma3ForCausalLM, Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3, "tie_word_embeddings": True}, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def build(kind: str, root: Path) -> tuple[Path, torch.nn.Module]:
    cls, cfg = CASES[kind]
    return random_hf_model(cls, cfg, root / kind)


def arch(heads: int, kv_heads: int, inter: int = 1536) -> ArchConfig:
    return ArchConfig("llama", 100, 576, inter, 2, heads, kv_heads, 64, 1e-5, 1e4, 512, True)


def test_heads_split_by_kv_groups() -> None:
    a = arch(9, 3)  # the default model's heads
    assert [head_ranges(a, Shard(r, 2)) for r in range(2)] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    local = [shard_arch(a, Shard(r, 2)) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.intermediate_size) for s in local] == [(6, 2, 768), (3, 1, 768)]
    # Fewer KV heads than ranks: each KV head on 2 ranks, its query heads split.
    assert [head_ranges(arch(4, 1), Shard(r, 2)) for r in range(2)] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    with pytest.raises(ValueError, match="do not split"):
        head_ranges(arch(6, 3), Shard(0, 4))
    # Intermediate splits land on ggml block boundaries (quantized down_proj columns stay in blocks).
    assert split_range(1536, 2, 1, 256) == (768, 1536) and split_range(1000, 3, 0) == (0, 334)


def _collectives(rank: int, size: int, address: object, backend: str, out: object) -> None:
    from tandem.parallel.comm import GroupComm

    comm = GroupComm(rank, size, torch.device("cpu"), address)
    x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
    reduced = comm.all_reduce(x)
    gathered = comm.all_gather(torch.full((rank + 1, 2), float(rank)))
    # rank r sends r + 1 + d rows to rank d, each row holding (sender, destination)
    parts = [torch.tensor([[rank, d]] * (rank + 1 + d), dtype=torch.int64) for d in range(size)]
    received = comm.all_to_all(parts)
    small = comm.broadcast_object({"step": 1} if rank == 0 else None)
    big = comm.broadcast_object(torch.arange(1 << 20) if rank == 0 else None)  # past the slot: via gloo
    out.put((rank, reduced.tolist(), [g.tolist() for g in gathered], [r.tolist() for r in received], small,
             int(big.sum())))
    comm.close()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_collectives_between_processes(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks: rank 0 here, two spawned; sums, uneven gathers and all-to-alls, small and large broadcasts."""
    from tandem.parallel.comm import GroupComm, start_rendezvous

    if backend == "gloo":
        monkeypatch.setenv("TANDEM_GROUP_COMM", "gloo")
    size = 3
    store, address = start_rendezvous(size, 1 << 16, torch.device("cpu"))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collectives, args=(r, size, address, backend, queue)) for r in range(1, size)]
    for p in procs:
        p.start()
    comm = GroupComm(0, size, torch.device("cpu"), address, store)
    assert comm.backend == backend
    reduced0 = comm.all_reduce(torch.arange(6, dtype=torch.float32).view(2, 3))
    comm.all_gather(torch.full((1, 2), 0.0))
    received0 = comm.all_to_all([torch.tensor([[0, d]] * (1 + d), dtype=torch.int64) for d in range(size)])
    comm.broadcast_object({"step": 1})
    comm.broadcast_object(torch.arange(1 << 20))
    results = {}
    for _ in range(size - 1):
        r = queue.get(timeout=120)
        results[r[0]] = r[1:]
    for p in procs:
        p.join(60)
    comm.close()
    expected_sum = (torch.arange(6, dtype=torch.float32).view(2, 3) * 6).tolist()  # ranks 1 + 2 + 3
    assert reduced0.tolist() == expected_sum
    assert [r.tolist() for r in received0] == [[[s, 0]] * (s + 1) for s in range(size)]
    assert sorted(results) == [1, 2]
    for rank, (reduced, gathered, received, small, big) in results.items():
        assert reduced == expected_sum
        assert gathered == [[[float(s)] * 2] * (s + 1) for s in range(size)]
        assert received == [[[s, rank]] * (s + 1 + rank) for s in range(size)]
        assert small == {"step": 1} and big == (1 << 20) * ((1 << 20) - 1) // 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("tp")
    return {kind: build(kind, root) for kind in CASES}


@pytest.mark.parametrize("kind,layers", [(kind, "native") for kind in CASES] + [("llama-uneven", "python")])
def test_tp2_greedy_matches_transformers(kind: str, layers: str, models, monkeypatch) -> None:  # noqa: ANN001
    """Two ranks, prompts in chunks of 16 tokens, a shared 24-token head served from the prefix cache;
    the layers in the native stack (its all-reduces in C++, ops/group_reduce.cpp) or the Python loop."""
    if layers == "python":
        monkeypatch.setenv("TANDEM_NATIVE_LAYERS", "0")  # the follower inherits it
    path, ref = models[kind]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_blocks=48, block_size=4,
              max_num_batched_tokens=16)
    try:
        assert llm.engine.core.runner.comm.size == 2
        gen = np.random.default_rng(1)
        head = gen.integers(0, 96, 24).tolist()
        prompts = [gen.integers(0, 96, n).tolist() for n in (3, 9, 40)] + [head + [5, 6], head + [7]]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate(prompts[:3] + prompts[3:4], params)
        outs += llm.generate(prompts[4:], params)  # its head is cached by now
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(ref, p, 10)
        assert outs[-1].num_cached_tokens >= 20
        assert (llm.engine.core.runner.model.native_steps > 0) == (layers == "native")
        assert_pool_clean(llm.engine)
    finally:
        llm.close()


def test_tp2_speculative_decoding_matches_transformers(models) -> None:  # noqa: ANN001
    """Drafts verified across the group: a copy-heavy prompt, n-gram drafts, the same greedy tokens."""
    path, ref = models["llama-uneven"]
    placement = os.sched_getaffinity(0), torch.get_num_threads()
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_blocks=64, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    try:
        base = np.random.default_rng(2).integers(0, 96, 12).tolist()
        prompt = base * 3
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)
        assert llm.engine.core.spec.stats.num_draft_tokens > 0
        assert_pool_clean(llm.engine)
        # An idle group's death is noticed between steps (a worker's heartbeat checks it), not first by
        # the next request's collective.
        llm.engine.core.check_alive()
        [follower] = _followers(os.getpid())
        os.kill(follower, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(GroupFailed, match="exited"):
            while time.monotonic() < deadline:
                llm.engine.core.check_alive()
                time.sleep(0.05)
    finally:
        llm.close()
    # Rank 0 was this process, pinned to its cores while the group lived: as it was again.
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == placement


def _followers(root: int) -> list[int]:
    """The worker-group followers among root's descendants."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children(pid):
            todo.append(child)
            if b"tandem.engine.worker_group" in cmdline(child):
                found.append(child)
    return found


@pytest.mark.slow
def test_a_killed_rank_fails_its_groups_requests_and_the_group_restarts() -> None:
    """kill -9 of rank 1 mid-stream: the stream ends with an error (never hangs), the engine core exits,
    the server starts the group again (a new rank 1), and the next request is served."""
    with running_server("--tensor-parallel-size", "2", "--kv-cache-memory", "0.25", "--max-num-seqs", "8") as s:
        [rank1] = _followers(s.proc.pid)
        body = {"prompt": "Count: one two three", "max_tokens": 400, "ignore_eos": True, "stream": True}
        chunks: list[str] = []
        with web.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                chunks.append(line)
                if len(chunks) == 10:
                    os.kill(rank1, signal.SIGKILL)
        text = "\n".join(chunks)
        assert "error" in text and text.count('"text"') < 400
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if web.get(f"{s.url}/health").status_code == 200 and _followers(s.proc.pid):
                break
            time.sleep(0.5)
        assert _followers(s.proc.pid) not in ([], [rank1])
        r = web.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                     timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
