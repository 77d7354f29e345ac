"""Engine flags: declared once (add_engine_args), read back by name (engine_kwargs), handed on to a
worker as a command line (engine_argv) that parses to the same options, and each known to the config."""

from __future__ import annotations

import argparse

from tandem.config import EngineConfig
from tandem.engine.args import ENGINE_DESTS, add_engine_args, engine_argv, engine_kwargs


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
