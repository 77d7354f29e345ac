"""The prefill -> decode hand-off in one process, on a tiny random model: a prefill engine ships the
KV layer by layer into blocks a decode engine reserved, and the decode engine's greedy tokens are
exactly a single engine's, whatever the chunking, the block boundaries, and which side already
caches part of the prompt. Every pool is clean afterwards.

The processes, sockets and failures around this are tested end to end in test_disaggregation.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tiny_models import build

from tandem.config import EngineConfig
from tandem.disagg.router.flight import migrated_request, prefill_request
from tandem.disagg.worker.kv_connectors import KVRecvConnector, KVSendConnector
from tandem.disagg.worker.transport import KVReceiver, TransferHandle
from tandem.disagg.worker.transports.factory import RoutingSender, make_receiver
from tandem.engine.connectors.base import KVConnector
from tandem.engine.core import EngineCore
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.request import Request
from tandem.model.loader import load_model
from tandem.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 96


def engine(path: Path, budget: int, receiver: KVReceiver | None = None, connector: KVConnector | None = None,
           kv_cache_dtype: str = "auto") -> EngineCore:
    config = EngineConfig.from_kwargs(str(path), dtype="float32", num_blocks=96, block_size=BLOCK,
                                      max_num_batched_tokens=budget, num_threads=1, kv_cache_dtype=kv_cache_dtype)
    # The receiving connector attaches its receiver to the pool.
    return EngineCore(config, load_model(str(path), torch.float32).model, connector,
                      shared_kv=receiver is not None and receiver.needs_shared_pool)


def prefill_engine(path: Path, budget: int, kv_cache_dtype: str = "auto") -> EngineCore:
    return engine(path, budget, connector=KVSendConnector(RoutingSender(b"k"), BLOCK), kv_cache_dtype=kv_cache_dtype)


def decode_engine(path: Path, budget: int, receiver: KVReceiver, kv_cache_dtype: str = "auto") -> EngineCore:
    return engine(path, budget, receiver, KVRecvConnector(receiver, BLOCK), kv_cache_dtype)


def run_colocated(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def run_disaggregated(prefill: EngineCore, decode: EngineCore, prompts: list[list[int]],
                      max_tokens: int) -> list[list[int]]:
    """What the router and the two workers do, minus the processes."""
    send, recv = prefill.connector, decode.connector
    assert isinstance(send, KVSendConnector) and isinstance(recv, KVRecvConnector)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    handles: dict[str, TransferHandle] = {}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        recv.expect(rid)
        decode.add_request(Request(rid, p, params))
        out[rid] = []
    while len(handles) < len(prompts):  # the decode engine allocates the reservations in its steps
        assert decode.step() == []
        handles.update((h.request_id, h) for h in recv.take_reserved())
    assert not decode.has_unfinished()  # waiting for KV needs no steps
    for i, p in enumerate(prompts):
        send.send_to(handles[f"r{i}"])
        prefill.add_request(Request.from_core_request(prefill_request(EngineCoreRequest(f"r{i}", tuple(p), params))))
    landing: dict[str, int] = {}
    while prefill.has_unfinished() or landing:
        for o in prefill.step():
            assert o.finish_reason == "length"  # max_tokens 1: decoding goes on elsewhere
            landing[o.request_id] = o.new_token_ids[0]
        for result in send.sender.poll():
            assert result.ok, result.error
            token = landing.pop(result.request_id)
            assert recv.arrived(result.request_id, token)
            out[result.request_id].append(token)
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def assert_clean(core: EngineCore) -> None:
    pool = core.scheduler.kv.pool
    assert not core.scheduler.requests and not core.scheduler.kv.req_blocks
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("tiny"))[0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8 rows travel as they are, scales in them
@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("budget", [3, 8, 64])  # chunks ending mid-block, on block edges, and whole prompts
def test_handoff_matches_a_single_engine(tiny: Path, transport: str, budget: int, kv_cache_dtype: str) -> None:
    rng = np.random.default_rng(budget)
    shared = rng.integers(0, VOCAB, 13).tolist()
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 4, 9, 23)]
    prompts += [shared + rng.integers(0, VOCAB, 6).tolist(), shared + rng.integers(0, VOCAB, 2).tolist()]
    reference = engine(tiny, budget, kv_cache_dtype=kv_cache_dtype)
    expected = run_colocated(reference, prompts, 6)
    receiver = make_receiver(transport, "127.0.0.1", 0, b"k")
    prefill = prefill_engine(tiny, budget, kv_cache_dtype)
    decode = decode_engine(tiny, budget, receiver, kv_cache_dtype)
    try:
        assert run_disaggregated(prefill, decode, prompts, 6) == expected
        # Again: now the decode side caches the prompts (only the tail is shipped) and so does the
        # prefill side (it computes only the last token but still ships what the decode side lacks).
        hits_before = decode.scheduler.kv.prefix_stats.hits
        assert run_disaggregated(prefill, decode, prompts, 6) == expected
        assert decode.scheduler.kv.prefix_stats.hits > hits_before
        # Prompts the decode side has never seen but the prefill side has: they must still arrive whole.
        assert decode.scheduler.kv.reset_prefix_cache()
        assert run_disaggregated(prefill, decode, prompts, 6) == expected
        for core in (reference, prefill, decode):
            assert_clean(core)
    finally:
        prefill.connector.sender.close()
        receiver.shutdown()


def test_a_reservation_is_private_until_admitted(tiny: Path) -> None:
    """Blocks whose KV has not arrived must not be served to a local request as a prefix hit."""
    receiver = make_receiver("shm")
    decode = decode_engine(tiny, 64, receiver)
    prompt = list(range(1, 20))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    decode.connector.expect("remote")
    decode.add_request(Request("remote", prompt, params))
    decode.step()
    assert [h.request_id for h in decode.connector.take_reserved()] == ["remote"]
    local = Request("local", prompt, params)
    hits, _ = decode.scheduler.kv.get_computed_blocks(local)
    assert hits == []
    with pytest.raises(ValueError, match="already in use"):
        decode.add_request(Request("remote", prompt, params))
    decode.abort(["remote"])
    assert_clean(decode)
    receiver.shutdown()


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_live_migration_goes_through_the_sending_connector(tiny: Path, transport: str) -> None:
    """What a migration does on the two workers, minus the processes: a decoding request is paused on a
    source engine, its computed KV leaves through the source's sending connector (read from the pool
    it registered: nothing else touches a pool) into a target's reservation, and the target decodes
    on to a single engine's greedy tokens. A reservation too small for the KV is refused with the
    reason, and nothing is sent."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, VOCAB, 21).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = run_colocated(engine(tiny, 64), [prompt], 12)
    receiver = make_receiver(transport, "127.0.0.1", 0, b"k")
    source = prefill_engine(tiny, 64)  # a sending connector alone: a colocated worker's, less its receiver
    target = decode_engine(tiny, 64, receiver)
    send, recv = source.connector, target.connector
    assert isinstance(send, KVSendConnector) and isinstance(recv, KVRecvConnector)
    try:
        request = Request("m", prompt, params)
        source.add_request(request)
        produced: list[int] = []
        while len(produced) < 5:
            produced += [t for o in source.step() for t in o.new_token_ids]
        paused = source.pause("m")
        assert paused is not None and list(paused.output_token_ids) == produced
        block_ids = source.scheduler.kv.get_block_ids("m")
        recv.expect("m")
        moved = migrated_request(EngineCoreRequest("m", tuple(prompt), params), produced)  # the router's copy
        target.add_request(Request.from_core_request(moved))
        while not (handles := recv.take_reserved()):
            assert target.step() == []
        [handle] = handles
        short = replace(handle, block_ids=handle.block_ids[:2])
        assert "the reservation holds 2 blocks" in send.migrate(short, block_ids, paused.num_computed_tokens)
        assert send.migrate(handle, block_ids, paused.num_computed_tokens) is None
        deadline = time.monotonic() + 30
        while not (results := send.sender.poll()):
            assert time.monotonic() < deadline, "the migration's KV never landed"
            time.sleep(0.001)
        assert [(r.request_id, r.ok) for r in results] == [("m", True)]
        end = -(-paused.num_computed_tokens // BLOCK)
        src, dst = (torch.tensor(ids[:end]) for ids in (block_ids, handle.block_ids))
        pools = source.runner.kv_pool, target.runner.kv_pool
        for layer in range(pools[0].shape[0]):  # every computed block, bit for bit
            assert torch.equal(pools[1].read_layer(layer, dst), pools[0].read_layer(layer, src))
        source.abort(["m"])  # the source frees it once the KV has landed
        assert recv.arrived("m", produced[-1])
        while target.has_unfinished():
            produced += [t for o in target.step() for t in o.new_token_ids]
        assert produced == expected
        for core in (source, target):
            assert_clean(core)
    finally:
        send.sender.close()
        receiver.shutdown()
