"""Step times measured once per machine, model and settings, and reused by the next start.

Timing the engine's steps (spec_profile.py) costs a server 2-5 s at every start on two cores, and
more on a slow one, for numbers that only change when something they depend on changes. A profile is
kept under the cache directory, keyed by everything that sets a step's time: the model's weights
(its fingerprint) and dtype, the KV layout, the passes the profile times, the threads, the kernels'
build (which names the CPU's features) and the CPU model. A server that restarts with the same key
reads it back. What the key cannot see (another process now sharing the cores) is what the live
correction factor already follows (speed.py SpeedTracker), so an entry older than MAX_AGE_S is
measured again rather than trusted for ever. Deleting the directory forces a new measurement.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from tandem.cache import cache_dir
from tandem.config import EngineConfig
from tandem.cpu_info import cpu_model_name
from tandem.ops.extension import build_dir, kernels_disabled

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_AGE_S = 7 * 24 * 3600
# Environment that changes which kernels run (secrets and paths stay out of the key).
_KEYED_ENV = ("TANDEM_DISABLE_KERNELS", "TANDEM_KERNEL_CFLAGS", "TANDEM_NATIVE_LAYERS", "TANDEM_QUANT_GEMM_ROWS")


PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The layers above the engine (pyproject.toml's import contracts): the engine imports none of them, so
# nothing in them can change what a step costs, and a change there (the server, the router, the CLI) does
# not cost every server configuration a new profile (5-6 s each for the default model on 2 cores).
ABOVE_THE_ENGINE = ("cli", "sim", "disagg", "serve", "bench", "policy", "llm")


@functools.cache
def code_stamp(root: Path = PACKAGE_ROOT) -> str:
    """The Python sources of the engine and the layers below it (names and contents): a change to the
    code that runs a step is a new key, as a change to the kernels' sources is a new build. By content,
    not modification time, so another checkout of the same code (a fresh clone, a worktree) reads the
    profiles back (~2 MB hashed once per process, a few ms)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0].removesuffix(".py") in ABOVE_THE_ENGINE:
            continue
        h.update(f"{path.relative_to(root)}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def profile_key(kind: str, config: EngineConfig, fingerprint: int, measured: dict) -> str:
    """The key of one profile kind for this engine (fingerprint: its weights', model/fingerprint.py).
    measured: what the profile times (its passes' sizes), derived from the settings it reads, so that
    a setting that changes no pass it times (the pool beyond the largest decode batch, a scheduling
    policy) reuses the profile rather than costing a start a new one."""
    parts = {
        "kind": kind, "code": code_stamp(), "torch": torch.__version__, "fingerprint": fingerprint,
        "model": [str(config.model.torch_dtype), config.model.quantization, config.model.deterministic],
        "cache": [config.cache.block_size, config.cache.kv_cache_dtype], "measured": measured,
        "parallel": repr(config.parallel), "threads": torch.get_num_threads(),
        "kernels": "off" if kernels_disabled() else build_dir().name, "cpu": cpu_model_name(),
        "env": {k: os.environ.get(k) for k in _KEYED_ENV},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _path(key: str) -> Path:
    return cache_dir() / "step-times" / f"{key}.json"


def load(key: str) -> dict | None:
    """A stored profile younger than MAX_AGE_S, or None."""
    path = _path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or time.time() - float(data.get("measured_at", 0)) > MAX_AGE_S:
        return None
    return data.get("profile")


def save(key: str, profile: dict) -> None:
    """Store a profile (atomically: another process may read or write the same key)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"measured_at": time.time(), "profile": profile}))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a measurement, nothing more
        log.debug("could not store step times in %s: %s", path, e)


def measured(key: str, measure: Callable[[], T], encode: Callable[[T], dict],
             decode: Callable[[dict], T]) -> tuple[T, bool]:
    """The profile stored under key, or measure() (then stored); and whether it was read back. An
    entry that does not decode is measured again and replaced."""
    stored = load(key)
    if stored is not None:
        try:
            return decode(stored), True
        except (KeyError, TypeError, ValueError):
            log.debug("step times under %s do not decode: measured again", key)
    value = measure()
    save(key, encode(value))
    return value, False
