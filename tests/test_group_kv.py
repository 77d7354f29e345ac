"""KV in and out of a worker group (kv/pool.py): rank 0 reads and writes every rank's KV heads.

A TP 2 prefill group sends to a TP 3 decode group (the 3 KV heads split 2:1 on one side, 1:1:1 on the
other: every block re-split by head on the way), over both transports; a group saves to the tiered
store and loads from it, and blocks saved by one size of group are loaded by another. Each equals
transformers (or a one-process engine) token for token under greedy float32, and leaves every KV
block free.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_hf_model
from test_disagg_handoff import assert_clean, run_disaggregated
from test_kv_store import conversations, run, store_of
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.config import EngineConfig
from tandem.disagg.worker.kv_connectors import KVRecvConnector, KVSendConnector
from tandem.disagg.worker.transports.factory import RoutingSender, make_receiver
from tandem.engine.core import EngineCore
from tandem.engine.worker_group import load_engine_model
from tandem.kv.pool import KVPool, PoolPart, map_shared, shared_zeros

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    # 3 KV heads, as the default model's: 2 and 1 over two ranks, one each over three.
    cfg = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    return random_hf_model(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("group-kv") / "llama")


def group_engine(path: Path, tp: int, connector: object = None, receiver: object = None,  # noqa: ANN001
                 num_blocks: int = 96, budget: int = 8, **options: object) -> EngineCore:
    config = EngineConfig.from_kwargs(str(path), dtype="float32", num_blocks=num_blocks, block_size=BLOCK,
                                      max_num_batched_tokens=budget, num_threads=2, tensor_parallel_size=tp,
                                      **options)
    # The receiving connector attaches its receiver to the pool.
    return EngineCore(config, load_engine_model(config).model, connector,
                      shared_kv=receiver is not None and receiver.needs_shared_pool)


def close_all(*cores: EngineCore) -> None:
    """Last started first: each group gives back the cores and threads its caller had when it started."""
    for core in reversed(cores):
        core.close()


def test_pool_reads_each_head_once_and_writes_every_copy() -> None:
    shape = (2, 2, 5, BLOCK, 3, 8)  # layers, K/V, blocks, block size, heads, row
    split = KVPool([PoolPart((0, 2), torch.zeros(2, 2, 5, BLOCK, 2, 8)),
                    PoolPart((2, 3), torch.zeros(2, 2, 5, BLOCK, 1, 8))])
    kv = torch.randn(2, 2, BLOCK, 3, 8)
    split.write_layer(1, [4, 0], kv)
    assert torch.equal(split.read_layer(1, torch.tensor([4, 0])), kv)
    assert torch.equal(split.parts[1].tensor[1][:, [4, 0]], kv[..., 2:3, :])  # the last head on the second rank
    assert split.shape == shape and split.block_nbytes == 2 * 2 * BLOCK * 3 * 8 * 4
    block = split.read_blocks(torch.tensor([0]))
    assert block.shape == (1, 2, 2, BLOCK, 3, 8)
    split.write_block(3, block[0].view(torch.uint8).numpy().reshape(-1))
    assert torch.equal(split.read_blocks(torch.tensor([3])), block)
    # One KV head held by both ranks: reads take the first copy, writes reach both.
    shared, where = shared_zeros((1, 2, 5, BLOCK, 1, 8), torch.float32)
    copies = KVPool([PoolPart((0, 1), shared, where), PoolPart((0, 1), torch.zeros(1, 2, 5, BLOCK, 1, 8))])
    one = torch.randn(2, 1, BLOCK, 1, 8)
    copies.write_layer(0, [2], one)
    assert torch.equal(copies.parts[1].tensor[0][:, [2]], one)
    assert torch.equal(map_shared(where)[0][:, [2]], one)  # another mapping of the memfd sees the write
    # A view of rank 0's heads only (a group whose pools are not shared) refuses rather than send part of a block.
    partial = KVPool([PoolPart((0, 2), torch.zeros(2, 2, 5, BLOCK, 2, 8))], num_kv_heads=3)
    with pytest.raises(RuntimeError, match="not shared"):
        partial.read_layer(0, torch.tensor([0]))


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_tp2_prefill_group_to_tp3_decode_group(model: tuple[Path, torch.nn.Module], transport: str) -> None:
    """Chunks of 8 tokens (transfers layer by layer over several steps, blocks partly filled and sent
    again), a prompt shorter than a block and long ones; the decode group decodes what transformers does."""
    path, ref = model
    receiver = make_receiver(transport, "127.0.0.1", 0, b"k" * 32)
    prefill = group_engine(path, 2, KVSendConnector(RoutingSender(b"k" * 32), BLOCK))
    decode = group_engine(path, 3, KVRecvConnector(receiver, BLOCK), receiver)
    try:
        assert [len(p.parts) for p in (prefill.runner.kv_pool, decode.runner.kv_pool)] == [2, 3]
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 96, n).tolist() for n in (3, 13, 30)]
        outs = run_disaggregated(prefill, decode, prompts, 8)
        assert outs == [hf_greedy(ref, p, 8) for p in prompts]
        assert_clean(prefill)
        assert_clean(decode)
    finally:
        receiver.shutdown()
        close_all(prefill, decode)


@pytest.fixture
def shm_path() -> Iterator[str]:
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:12]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_a_group_saves_to_and_loads_from_the_store(model: tuple[Path, torch.nn.Module], shm_path: str) -> None:
    """A TP 2 group's 24-block pool holds about one conversation: later turns reload their histories from
    the host tier into both ranks' heads, and answer as a one-process engine with room for all does."""
    path, _ = model
    whole = group_engine(path, 1, num_blocks=256)
    expected = conversations(whole)
    whole.close()
    core = group_engine(path, 2, num_blocks=24, kv_offload_memory=0.01, kv_offload_path=shm_path)
    try:
        assert conversations(core) == expected
        store = store_of(core)
        assert store.counters.tier_hits.get("host", 0) > 0 and store.counters.loaded_tokens > 0
        assert_clean(core)
    finally:
        close_all(core)


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1)])
def test_blocks_saved_by_one_group_size_load_in_another(model: tuple[Path, torch.nn.Module], tmp_path: Path,
                                                         sizes: tuple[int, int]) -> None:
    """The store keeps whole blocks (every KV head): what TP 1 saved, TP 2 loads, and back."""
    path, ref = model
    disk = dict(kv_offload_disk=str(tmp_path / "kv"), kv_offload_disk_size=0.01)
    prompt = np.random.default_rng(4).integers(0, 96, 30).tolist()
    first = group_engine(path, sizes[0], **disk)
    try:
        assert run(first, [prompt], "a") == [hf_greedy(ref, prompt, 6)]
    finally:
        close_all(first)
    second = group_engine(path, sizes[1], **disk)
    try:
        assert run(second, [prompt], "b") == [hf_greedy(ref, prompt, 6)]
        assert store_of(second).counters.tier_hits == {"disk": (len(prompt) - 1) // BLOCK}
        assert_clean(second)
    finally:
        close_all(second)
