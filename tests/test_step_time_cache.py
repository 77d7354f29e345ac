"""Step times are measured once per machine, model and settings, and read back by the next start
(engine/step_time_cache.py): what changes a step's time is a new key, and a stale entry is measured
again."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from tiny_served_model import tiny_served_model

import tandem.engine.core as core_module
from tandem.config import SpeculativeConfig
from tandem.engine import step_time_cache
from tandem.engine.spec_profile import SpeedPasses, profile_speed, speed_passes
from tandem.engine.step import SchedulerOutput


@pytest.fixture
def counted_profiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    measure = core_module.profile_speed

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(core_module, "profile_speed", counted)
    return calls


def test_a_second_start_reads_the_first_starts_step_times(make_llm, counted_profiles: list[int], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_llm(model=str(tiny_served_model()), dtype="float32", kv_cache_memory=0.0625).engine.core
    # After the engine is built: the kernels' build lives under the same directory.
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    first = core.profile_speed()
    assert counted_profiles == [1]
    assert len(list((tmp_path / "step-times").glob("*.json"))) == 1
    again = core.profile_speed()  # the same engine, settings and machine: the same key
    assert counted_profiles == [1] and again == first

    # Older than MAX_AGE_S: measured again (what the key cannot see may have changed).
    (entry,) = (tmp_path / "step-times").glob("*.json")
    data = json.loads(entry.read_text())
    data["measured_at"] = time.time() - step_time_cache.MAX_AGE_S - 1
    entry.write_text(json.dumps(data))
    core.profile_speed()
    assert counted_profiles == [1, 1]
    # An unreadable entry is measured again too, and replaced.
    entry.write_text("{not json")
    core.profile_speed()
    assert counted_profiles == [1, 1, 1] and json.loads(entry.read_text())["profile"]["decode_rows"]


def test_what_sets_a_steps_time_is_in_the_key(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_llm(model=str(tiny_served_model()), dtype="float32", kv_cache_memory=0.0625).engine.core
    config = core.config

    def key(cfg=config, fingerprint: int = 1, num_blocks: int = 4096, max_model_len: int = 512) -> str:  # noqa: ANN001
        sc = cfg.scheduler
        passes = speed_passes(sc.max_num_batched_tokens, sc.max_num_seqs, num_blocks, max_model_len,
                              cfg.cache.block_size)
        return step_time_cache.profile_key("step-speed", cfg, fingerprint, asdict(passes))

    base = key()
    assert key() == base
    # What no timed pass depends on reuses the profile: a pool larger than the largest decode batch
    # needs, a scheduling policy, speculation (its own profile is another kind).
    assert key(num_blocks=8192) == base
    assert key(replace(config, scheduler=replace(config.scheduler, long_prefill_token_threshold=64,
                                                 contended_prefill_chunk=32))) == base
    assert key(replace(config, speculative=SpeculativeConfig())) == base
    others = [
        key(fingerprint=2), key(num_blocks=64), key(max_model_len=256),
        key(replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=64))),
        key(replace(config, scheduler=replace(config.scheduler, max_num_seqs=4))),
        key(replace(config, model=replace(config.model, dtype="bfloat16"))),
        key(replace(config, cache=replace(config.cache, kv_cache_dtype="int8"))),
        step_time_cache.profile_key("spec-step-cost", config, 1, {"counts": [1, 2]}),
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        others.append(key())
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("TANDEM_DISABLE_KERNELS", "1")
    others.append(key())
    assert base not in others and len(set(others)) == len(others)


def test_the_code_stamp_follows_the_sources_content_not_where_or_when_they_were_written(tmp_path: Path) -> None:
    """Another checkout of the same code (a fresh clone: new paths, new modification times) reads the
    same profiles; a changed source does not."""
    copy = tmp_path / "tandem"
    shutil.copytree(step_time_cache.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    some = copy / "engine" / "step_time_cache.py"
    os.utime(some, (1, 1))  # as old as can be: a checkout writes its own times
    assert step_time_cache.code_stamp(copy) == step_time_cache.code_stamp()
    fresh = tmp_path / "again"
    shutil.copytree(copy, fresh)
    (fresh / "engine" / "step_time_cache.py").write_text(some.read_text() + "\n# changed\n")
    assert step_time_cache.code_stamp(fresh) != step_time_cache.code_stamp()


def test_the_code_stamp_covers_what_runs_a_step_and_not_the_layers_above_it(tmp_path: Path) -> None:
    """A change to the server, router or CLI (which the engine never imports) keeps the profiles; a change
    to a model or a kernel's Python side, or a settings module below the engine, makes new ones."""
    base = tmp_path / "tandem"
    shutil.copytree(step_time_cache.PACKAGE_ROOT, base, ignore=shutil.ignore_patterns("__pycache__"))
    stamp = step_time_cache.code_stamp(base)
    for layer, same in (("serve/api.py", True), ("disagg/router/disagg_engine.py", True), ("cli/serve.py", True),
                        ("llm.py", True), ("model/llama.py", False), ("ops/extension.py", False), ("config.py", False)):
        changed = tmp_path / layer.replace("/", "-")
        shutil.copytree(base, changed)
        source = changed / layer
        source.write_text(source.read_text() + "\n# changed\n")
        assert (step_time_cache.code_stamp(changed) == stamp) is same, layer


def test_the_layers_left_out_of_the_code_stamp_are_those_the_import_contract_puts_above_the_engine() -> None:
    """ABOVE_THE_ENGINE restates pyproject.toml's layers: the two cannot drift apart."""
    import tomllib

    config = tomllib.loads((step_time_cache.PACKAGE_ROOT.parent / "pyproject.toml").read_text())
    [layers] = [c["layers"] for c in config["tool"]["importlinter"]["contracts"]
                 if c["type"] == "layers" and c["containers"] == ["tandem"]]
    above = [name.strip() for layer in layers[:layers.index("engine")] for name in layer.split("|")]
    assert sorted(above) == sorted(step_time_cache.ABOVE_THE_ENGINE)


def test_the_profiled_decode_rows_are_decode_rows_to_the_runner(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile times decode batches on the runner's decode path (with the shipped batch-invariant
    kernels a prompt's last token is a prompt row, about 1.5x the cost: the profile had predicted every
    decode step that much too slow)."""
    core = make_llm(model=str(tiny_served_model()), dtype="float32", kv_cache_memory=0.0625).engine.core
    runner = core.runner
    assert runner.deterministic, "the shipped default"
    rows: list[bool] = []
    execute = runner.execute

    def spy(sched: SchedulerOutput) -> object:
        rows.extend(runner._decode_row(s) for s in sched.scheduled
                    if s.request.request_id.startswith("speed-profile-"))  # the decode passes' rows
        return execute(sched)

    monkeypatch.setattr(runner, "execute", spy)
    profile_speed(runner, SpeedPasses(budget=32, top=8, context=40))
    assert len(rows) >= 1 + 8 and all(rows), rows
