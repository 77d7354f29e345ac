"""The engine core process of a single server, started before the server's own process imports torch
and its app: the core's imports and model load then run beside the server's on the other core
(a default server answered /health 5.9 s after its start on a 2-core Zen 3, ~2 s of which was the
server's imports before the core was even started). Light on purpose: nothing here imports torch;
the core builds its engine settings from the same flags the server builds its own from."""

from __future__ import annotations

import multiprocessing
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.config import EngineConfig


@dataclass
class CoreLaunch:
    """A core process started, and where it talks (AsyncEngine adopts it)."""

    proc: multiprocessing.process.BaseProcess
    tmp: tempfile.TemporaryDirectory
    addresses: tuple[str, str]  # the core's input and output sockets


def core_addresses(tmp: tempfile.TemporaryDirectory) -> tuple[str, str]:
    base = Path(tmp.name)
    return f"ipc://{base / 'in'}", f"ipc://{base / 'out'}"


def run_core_from_flags(model: str | None, engine_options: dict[str, Any], input_addr: str, output_addr: str,
                        log_level: str, kv_events_endpoint: str | None, profile_speed: bool) -> None:
    """Process entry point: the engine settings built here from the flags (engine/args.py engine_kwargs)."""
    from tandem.config import EngineConfig

    try:
        config = EngineConfig.from_kwargs(model, **engine_options)
    except ValueError:
        raise SystemExit(2) from None  # the server builds the same settings and reports what is wrong
    run_core(config, input_addr, output_addr, log_level, kv_events_endpoint, profile_speed)


def run_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str,
             kv_events_endpoint: str | None, profile_speed: bool) -> None:
    """Process entry point of a core the API process starts again: the engine (and torch) is imported
    in the child, so the API process never imports it."""
    from tandem.serve.core_proc import run_engine_core

    run_engine_core(config, input_addr, output_addr, log_level, kv_events_endpoint, profile_speed)


def launch_core(model: str | None, engine_options: dict[str, Any], log_level: str, kv_events_endpoint: str | None,
                profile_speed: bool) -> CoreLaunch:
    tmp = tempfile.TemporaryDirectory(prefix="tandem-")
    addresses = core_addresses(tmp)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_core_from_flags,
        args=(model, engine_options, *addresses, log_level, kv_events_endpoint, profile_speed),
        daemon=True, name="tandem-engine-core")
    proc.start()
    return CoreLaunch(proc, tmp, addresses)
