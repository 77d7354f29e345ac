"""Every workload generator: reproducible from its seed, and shaped as asked."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench_stub_server import WordTokenizer

from tandem.bench.arrivals import session_offsets
from tandem.bench.workloads import DATASETS, TextMaker, WorkloadConfig, generate


@pytest.fixture(scope="module")
def maker() -> TextMaker:
    return TextMaker(WordTokenizer())


def trace_file(tmp_path: Path, rows: list[dict[str, Any]]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


TRACE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]},
    {"timestamp": 1500, "input_length": 700, "output_length": 20, "hash_ids": [7, 8]},
    {"timestamp": 1250, "input_length": 600, "output_length": 5, "hash_ids": [7, 3]},
    {"timestamp": 3000, "input_length": 100, "output_length": 1, "hash_ids": [4]},
]


def config(name: str, tmp_path: Path, **kw: Any) -> WorkloadConfig:
    base = dict(dataset_name=name, num_prompts=40, seed=3, random_input_len=64, random_output_len=16,
                random_range_ratio=0.5, prefix_repetition_prefix_len=32, prefix_repetition_suffix_len=16,
                prefix_repetition_num_prefixes=4, long_short_long_input_len=300, long_short_long_fraction=0.1,
                long_short_short_input_len=20, multi_turn_input_len=12, multi_turn_turns=3,
                synthetic_chat_max_len=512)
    if name == "mooncake_trace":
        base["dataset_path"] = trace_file(tmp_path, TRACE)
    return WorkloadConfig(**(base | kw))


def flat(sessions: list) -> list:  # noqa: ANN001
    return [(s.timestamp, [(t.prompt, t.prompt_len, t.expected_output_len, t.category) for t in s.turns])
            for s in sessions]


@pytest.mark.parametrize("name", DATASETS)
def test_reproducible_from_seed(name: str, maker: TextMaker, tmp_path: Path) -> None:
    a = generate(config(name, tmp_path), maker)
    b = generate(config(name, tmp_path), maker)
    c = generate(config(name, tmp_path, seed=4), maker)
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    # The recorded prompt lengths are the tokenizer's own count.
    for s in a:
        for t in s.turns:
            assert t.prompt_len == maker.count(t.prompt) > 0


def test_random_lengths(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("random", tmp_path, num_prompts=200, random_prefix_len=5), maker)
    ins = [s.turns[0].prompt_len for s in sessions]
    outs = [s.turns[0].expected_output_len for s in sessions]
    assert len(sessions) == 200 and all(len(s.turns) == 1 and s.timestamp is None for s in sessions)
    assert min(ins) >= 5 + 32 and max(ins) <= 5 + 96 and len(set(ins)) > 20
    assert min(outs) >= 8 and max(outs) <= 24
    prefixes = {tuple(s.turns[0].prompt.split()[:5]) for s in sessions}
    assert len(prefixes) == 1  # --random-prefix-len: one prefix shared by every prompt
    fixed = generate(config("random", tmp_path, random_range_ratio=0.0), maker)
    assert {(s.turns[0].prompt_len, s.turns[0].expected_output_len) for s in fixed} == {(64, 16)}
    with pytest.raises(ValueError):
        generate(config("random", tmp_path, random_range_ratio=1.0), maker)


def test_synthetic_chat_distribution(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("synthetic_chat", tmp_path, num_prompts=400, synthetic_chat_max_len=2048), maker)
    ins = [s.turns[0].prompt_len for s in sessions]
    outs = [s.turns[0].expected_output_len for s in sessions]
    assert min(ins) >= 4 and max(ins) <= 1024 and min(outs) >= 4
    assert all(i + o <= 2048 for i, o in zip(ins, outs, strict=True))
    # Lognormal around the asked means (220 in, 200 out), with a long tail: mean well above median.
    assert 170 < sum(ins) / len(ins) < 270 and 150 < sum(outs) / len(outs) < 250
    assert sorted(ins)[200] < sum(ins) / len(ins)


def test_prefix_repetition(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("prefix_repetition", tmp_path), maker)
    groups: dict[str, list[list[str]]] = {}
    for s in sessions:
        t = s.turns[0]
        assert t.prompt_len == 48 and t.expected_output_len == 128
        groups.setdefault(t.category, []).append(t.prompt.split())
    assert sorted(groups) == ["prefix0", "prefix1", "prefix2", "prefix3"]
    assert all(len(g) == 10 for g in groups.values())
    heads = {cat: {tuple(w[:32]) for w in g} for cat, g in groups.items()}
    assert all(len(h) == 1 for h in heads.values())  # one prefix per group...
    assert len({next(iter(h)) for h in heads.values()}) == 4  # ...and four different ones
    assert len({tuple(w[32:]) for g in groups.values() for w in g}) == 40  # suffixes all differ
    cats = [s.turns[0].category for s in sessions]
    assert cats != sorted(cats)  # groups are interleaved, not back to back


def test_multi_turn(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("multi_turn", tmp_path, num_prompts=5, multi_turn_output_len=7), maker)
    assert len(sessions) == 5
    for s in sessions:
        assert [t.category for t in s.turns] == ["turn1", "turn2", "turn3"]
        assert all(t.prompt_len == 12 and t.expected_output_len == 7 for t in s.turns)
        assert len({t.prompt for t in s.turns}) == 3


def test_long_short(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("long_short", tmp_path, num_prompts=50), maker)
    longs = [s.turns[0] for s in sessions if s.turns[0].category == "long"]
    shorts = [s.turns[0] for s in sessions if s.turns[0].category == "short"]
    assert len(longs) == 5 and len(shorts) == 45
    assert all(t.prompt_len == 300 and t.expected_output_len == 16 for t in longs)
    assert all(t.prompt_len == 20 and t.expected_output_len == 128 for t in shorts)
    first_long = [i for i, s in enumerate(sessions) if s.turns[0].category == "long"]
    other = generate(config("long_short", tmp_path, num_prompts=50, seed=9), maker)
    assert first_long != [i for i, s in enumerate(other) if s.turns[0].category == "long"]


def test_mooncake_trace(maker: TextMaker, tmp_path: Path) -> None:
    sessions = generate(config("mooncake_trace", tmp_path, trace_time_scale=0.5), maker)
    # Sorted by time, relative to the first, in seconds, scaled.
    assert [s.timestamp for s in sessions] == [0.0, 0.125, 0.25, 1.0]
    assert session_offsets(sessions, 123.0) == [0.0, 0.125, 0.25, 1.0]
    by_out = {s.turns[0].expected_output_len: s.turns[0] for s in sessions}
    assert {o: t.prompt_len for o, t in by_out.items()} == {10: 1100, 20: 700, 5: 600, 1: 100}
    w10, w20, w5 = (by_out[o].prompt.split() for o in (10, 20, 5))
    assert w10[:700] == w20  # hash ids [7, 8] shared: the whole of the shorter prompt (512 + 188 tokens)
    assert w10[:512] == w5[:512] and w10[512:600] != w5[512:600]  # only block 7 shared
    assert w10[:100] != by_out[1].prompt.split()
    assert len(generate(config("mooncake_trace", tmp_path, num_prompts=2), maker)) == 2
    with pytest.raises(ValueError):
        generate(dataclasses.replace(config("mooncake_trace", tmp_path), dataset_path=None), maker)


def test_real_tokenizer_counts_exactly() -> None:
    """With the default model's byte-level BPE tokenizer, n words are n tokens and prefixes survive."""
    from tandem.tokenizer import load_tokenizer

    maker = TextMaker(load_tokenizer(None))
    sessions = generate(WorkloadConfig("random", num_prompts=20, seed=0, random_input_len=100, random_output_len=4,
                                       random_range_ratio=0.3), maker)
    for s in sessions:
        t = s.turns[0]
        assert len(t.prompt.split()) == t.prompt_len == len(maker.tokenizer.encode(t.prompt, add_special_tokens=False))
    tok = maker.tokenizer
    a, b = (maker.text(np.random.default_rng(k), 40) for k in (1, 2))
    shared = maker.text(np.random.default_rng(0), 64)
    ids_a = tok.encode(shared + a, add_special_tokens=False)
    ids_b = tok.encode(shared + b, add_special_tokens=False)
    assert ids_a[:64] == ids_b[:64] == tok.encode(shared, add_special_tokens=False)


def test_copy_prompts_hold_code_docs_and_json_that_ship_with_python(maker: TextMaker, tmp_path: Path) -> None:
    from tandem.bench.copy_tasks import COPY_TASKS

    sessions = generate(config("copy", tmp_path, num_prompts=6, copy_input_len=200, copy_output_len=64), maker)
    assert [s.turns[0].category for s in sessions] == list(COPY_TASKS) * 2
    assert all(s.turns[0].expected_output_len == 64 for s in sessions)
    code, docs, data = (sessions[i].turns[0].prompt for i in range(3))
    assert "```python\ndef " in code and code.rstrip().endswith("```")
    assert docs.startswith("Summarise") and len(docs) > 200
    records = json.loads(data[data.index("["):])  # cut at a whole record: still valid JSON
    assert records and all(set(r) == {"code", "phrase", "description"} for r in records)
    assert all(maker.count(s.turns[0].prompt) <= 200 + 40 for s in sessions)  # the budget plus the instruction
