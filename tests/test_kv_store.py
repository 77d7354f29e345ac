"""The tiered KV store through the engine, on a tiny random model: greedy outputs are identical with
the store on and off while a pool too small for the workload evicts and reloads from each tier; a
block saved by one engine is loaded by another; a corrupt block is recomputed, never used; keys are
equal across processes; aborts during loads leak nothing.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tiny_models import build

from tandem.config import EngineConfig
from tandem.engine.connectors.store import StoreConnector
from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.kv.store.mooncake_master import mooncake_available
from tandem.model.loader import load_model
from tandem.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 96
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("tiny"))[0]


@pytest.fixture
def shm_path() -> str:
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:12]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def engine(path: Path, num_blocks: int = 24, **store: object) -> EngineCore:
    config = EngineConfig.from_kwargs(str(path), dtype="float32", num_blocks=num_blocks, block_size=BLOCK,
                                      max_num_batched_tokens=16, num_threads=1, **store)
    return EngineCore(config, load_model(str(path), torch.float32).model)


def run(core: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(Request(f"{tag}-{i}", p, GREEDY))
    out: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    if isinstance(core.connector, StoreConnector):
        core.connector.flush()
    return list(out.values())


def conversations(core: EngineCore, turns: int = 3, seed: int = 0) -> list[list[int]]:
    """Four conversations, a turn at a time: each prompt is the last prompt, its answer and a new
    question, so every turn after the first starts with a history the pool may have evicted."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(0, VOCAB, 9 + 5 * i).tolist() for i in range(4)]
    outputs = []
    for t in range(turns):
        outs = run(core, histories, f"t{t}")
        outputs += outs
        histories = [h + o + rng.integers(0, VOCAB, 3).tolist() for h, o in zip(histories, outs, strict=True)]
    return outputs


def assert_clean(core: EngineCore) -> None:
    pool = core.scheduler.kv.pool
    assert not core.scheduler.requests and not core.scheduler.kv.req_blocks and not core.scheduler.loading
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def store_of(core: EngineCore) -> StoreConnector:
    assert isinstance(core.connector, StoreConnector)
    return core.connector


def tier_options(tiers: str, tmp_path: Path, shm_path: str) -> dict:
    options: dict = {}
    if "host" in tiers:
        options.update(kv_offload_memory=0.01, kv_offload_path=shm_path)
    if "disk" in tiers:
        options.update(kv_offload_disk=str(tmp_path / "kv"), kv_offload_disk_size=0.01)
    return options


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8 blocks are stored with their scales
@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_outputs_identical_with_the_store_while_a_small_pool_evicts(tiny: Path, tmp_path: Path, shm_path: str,
                                                                     tiers: str, kv_cache_dtype: str) -> None:
    expected = conversations(engine(tiny, num_blocks=256, kv_cache_dtype=kv_cache_dtype))
    core = engine(tiny, kv_cache_dtype=kv_cache_dtype, **tier_options(tiers, tmp_path, shm_path))
    assert conversations(core) == expected
    store = store_of(core)
    # The 24-block pool holds about one conversation: later turns reload their histories.
    lowest = tiers.split("+")[0]
    assert store.counters.tier_hits.get(lowest, 0) > 0 and store.counters.loaded_tokens > 0
    assert core.scheduler.stats().prefix_queries > 0
    assert_clean(core)
    core.close()


def test_a_block_saved_by_one_engine_is_loaded_by_another(tiny: Path, tmp_path: Path, shm_path: str) -> None:
    prompt = np.random.default_rng(1).integers(0, VOCAB, 30).tolist()
    first, second = engine(tiny, kv_offload_memory=0.01, kv_offload_path=shm_path), \
        engine(tiny, kv_offload_memory=0.01, kv_offload_path=shm_path)
    expected = run(first, [prompt], "a")
    second.add_request(Request("b", prompt, GREEDY))
    tokens: list[int] = []
    cached = 0
    while second.has_unfinished():
        for o in second.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    assert [tokens] == expected
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK  # everything but the block holding the last token
    assert store_of(second).counters.tier_hits == {"host": cached // BLOCK}
    for core in (first, second):
        assert_clean(core)
        core.close()


def corrupt_every_block(directory: Path) -> int:
    files = list(directory.rglob("*.kv"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF  # the payload's last byte: the header still parses
        f.write_bytes(bytes(raw))
    return len(files)


def test_a_corrupt_disk_block_is_recomputed_not_used(tiny: Path, tmp_path: Path) -> None:
    options = tier_options("disk", tmp_path, "")
    prompts = [np.random.default_rng(2).integers(0, VOCAB, 21).tolist()]
    expected = run(engine(tiny, num_blocks=256), prompts, "ref")
    run(engine(tiny, **options), prompts, "fill")
    assert corrupt_every_block(tmp_path / "kv") > 0
    core = engine(tiny, **options)  # a restart: the directory's index is rebuilt from its files
    assert run(core, prompts, "again") == expected
    tier = store_of(core).store.stats()["disk"]
    assert tier.verify_failures == 1 and tier.hits == 0  # the first block failed: the load stopped there
    assert_clean(core)
    core.close()


def test_aborts_during_loads_leak_nothing(tiny: Path, shm_path: str) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, 40).tolist() for _ in range(6)]
    core = engine(tiny, num_blocks=48, kv_offload_memory=0.01, kv_offload_path=shm_path)
    run(core, prompts, "warm")
    assert core.scheduler.kv.reset_prefix_cache()  # the pool forgets: everything comes from the store
    for round_ in range(3):
        ids = [f"s{round_}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            core.add_request(Request(rid, p, GREEDY))
        core.step()  # loads start
        assert core.scheduler.loading
        core.abort(ids[::2] + list(core.scheduler.loading)[:1])  # some while their KV is loading
        while core.has_unfinished():
            core.step()
        assert_clean(core)
    core.close()


def run_together(codes: list[str], envs: list[dict[str, str]] | None = None) -> list[str]:
    """Run Python programs as separate processes at the same time (each is mostly one core's import
    and load); their standard outputs, in order."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for code, env in zip(codes, envs or [None] * len(codes), strict=True)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [out for out, _ in outs]


def keys_code(path: Path, algo: str, kv_cache_dtype: str = "auto") -> str:
    """A program that prints the block keys an engine on path gives a salted 20-token prompt."""
    return ("import sys, torch\n"
            "from tandem.config import EngineConfig\n"
            "from tandem.engine.core import EngineCore\n"
            "from tandem.engine.request import Request\n"
            "from tandem.model.loader import load_model\n"
            "from tandem.sampling_params import SamplingParams\n"
            f"config = EngineConfig.from_kwargs({str(path)!r}, dtype='float32', num_blocks=16, block_size={BLOCK},"
            f" prefix_caching_hash_algo={algo!r}, kv_cache_dtype={kv_cache_dtype!r})\n"
            f"core = EngineCore(config, load_model({str(path)!r}, torch.float32).model)\n"
            "r = Request('r', list(range(20)), SamplingParams(), cache_salt='tenant')\n"
            "core.scheduler.kv.update_block_hashes(r)\n"
            "print(r.block_hashes)")


@pytest.mark.parametrize("algo", ["sha256"])
def test_block_keys_are_equal_in_another_process(tiny: Path, algo: str) -> None:
    """Keys carry the model's fingerprint and the block size; a router or another worker gets the same."""
    code = keys_code(tiny, algo)
    other = build("qwen2", tiny.parent)[0]  # other weights: other keys
    *runs, run_other = run_together([code, code, code.replace(str(tiny), str(other))])
    assert runs[0] == runs[1] and len(eval(runs[0])) == 5
    assert run_other != runs[0]


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_int8_cache_keys_are_equal_under_any_hash_seed(tiny: Path, algo: str) -> None:
    """An int8 cache's keys carry its layout's name, a str: they must not follow PYTHONHASHSEED, and
    must still differ from a float cache's (other bytes, never each other's hits)."""
    runs = (("int8", 1), ("int8", 2), ("auto", 1))
    int8, int8_again, float_keys = (ast.literal_eval(out) for out in run_together(
        [keys_code(tiny, algo, kv_cache_dtype) for kv_cache_dtype, _ in runs],
        [{**os.environ, "PYTHONHASHSEED": str(seed)} for _, seed in runs]))
    assert len(int8) == 5 and int8_again == int8
    assert set(float_keys).isdisjoint(int8)


def test_mooncake_tier_through_the_engine(tiny: Path) -> None:
    reason = mooncake_available()
    if reason is not None:
        pytest.skip(f"Mooncake Store is not usable here: {reason}")
    from tandem.kv.store.mooncake_master import start_local_master

    master, url = start_local_master()
    try:
        expected = conversations(engine(tiny, num_blocks=256), turns=2)
        core = engine(tiny, kv_store=url)
        assert conversations(core, turns=2) == expected
        assert store_of(core).counters.tier_hits.get("mooncake", 0) > 0
        assert_clean(core)
        core.close()
    finally:
        master.terminate()
        master.wait(10)
