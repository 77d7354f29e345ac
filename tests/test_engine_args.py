"""Engine flags: declared once (a settings field's flag(...)), parsed (add_engine_args), read back by name
(engine_kwargs), handed on to a worker as a command line (engine_argv) that parses to the same options,
each known to the config, and listed in docs/serving.md as declared."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tandem.config import EngineConfig, SchedulerConfig
from tandem.engine.args import (
    ENGINE_DESTS,
    ENGINE_SECTIONS,
    add_engine_args,
    engine_argv,
    engine_kwargs,
    flag_table,
    with_flag_table,
)
from tandem.flags import flag


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_a_command_line_survives_being_handed_on() -> None:
    argv = ["m.gguf", "--dtype", "float32", "--num-blocks", "64", "--no-enable-prefix-caching", "--deterministic",
            "--max-num-seqs", "3", "-tp", "2", "--kv-offload-memory", "0.5", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}', "--kv-store-ttl", "2.5"]
    args = parser().parse_args(argv)
    again = parser().parse_args(engine_argv(args))
    assert engine_kwargs(again) == engine_kwargs(args)
    assert again.model == "m.gguf" and engine_kwargs(args)["enable_prefix_caching"] is False
    assert set(engine_kwargs(args)) == set(ENGINE_DESTS) and "model" not in ENGINE_DESTS


def test_every_engine_flag_is_an_engine_option() -> None:
    config = EngineConfig()
    sections = (config.model, config.cache, config.scheduler, config.parallel)
    unknown = [d for d in ENGINE_DESTS
               if d != "speculative_config" and not any(d in s.__dataclass_fields__ for s in sections)]
    assert not unknown
    built = EngineConfig.from_kwargs("m.gguf", **engine_kwargs(parser().parse_args(["--num-blocks", "7"])))
    assert built.cache.num_blocks == 7


def test_the_docs_flag_table_is_the_declarations() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    assert with_flag_table(page) == page, "docs/serving.md's engine flags differ: run scripts/flag_table.py"
    assert all(f"`--{d.replace('_', '-')}`" in page for d in ENGINE_DESTS)


@dataclass
class _SchedulerWithAKnob(SchedulerConfig):
    """A settings section with one flag more, declared the one way a flag is."""

    test_knob: int = flag(3, "a test knob's help", group="test knobs")


def test_a_declared_field_is_a_flag_in_help_a_worker_and_the_docs_with_no_other_edit() -> None:
    sections = tuple(_SchedulerWithAKnob if s is SchedulerConfig else s for s in ENGINE_SECTIONS)
    p = argparse.ArgumentParser(prog="tandem serve")
    add_engine_args(p, sections)
    assert "--test-knob TEST_KNOB" in p.format_help() and "a test knob's help" in p.format_help()
    assert "test knobs:" in p.format_help()
    assert p.parse_args([]).test_knob == 3  # its declared default
    args = p.parse_args(["--test-knob", "5", "--max-num-seqs", "9"])
    worker_argv = engine_argv(args, sections)
    assert "--test-knob" in worker_argv
    worker = argparse.ArgumentParser()
    add_engine_args(worker, sections)
    handed_on = engine_kwargs(worker.parse_args(worker_argv), sections)
    assert handed_on["test_knob"] == 5 and handed_on == engine_kwargs(args, sections)
    assert "| `--test-knob` | `3` | a test knob's help |" in flag_table(sections)
    assert "--test-knob" not in parser().format_help()  # the shipped sections know nothing of it
