"""Builds and loads Tandem's compiled CPU ops: one torch extension, registered as ``torch.ops.tandem``.

The sources (``*.cpp`` and the ``*.h`` they include, next to this file) compile once per machine with
``torch.utils.cpp_extension`` into a cache directory keyed by everything that changes the binary.
``scripts/setup.sh`` builds it ahead of time (``tandem.ops.extension.main``), so nothing compiles on a
request's path.
Every op has a pure-PyTorch fallback, used when the extension is disabled, fails to build, or
the inputs do not suit it (another device, another dtype).

Environment:
  TANDEM_DISABLE_KERNELS=1  always use the PyTorch fallbacks.
  TANDEM_CACHE_DIR          root of the build cache (default ~/.cache/tandem); builds go to
                            ``$TANDEM_CACHE_DIR/ext/<hash of sources, torch version, flags>``.
  TANDEM_KERNEL_CFLAGS      extra compiler flags, e.g. ``-mno-avx512f`` to build and test the AVX2
                            paths on an AVX512 machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.cache import cache_dir

logger = logging.getLogger(__name__)

EXT_NAME = "tandem_ops"
_HERE = Path(__file__).parent
_SOURCES = [_HERE / "paged_attention.cpp", _HERE / "paged_prefill.cpp", _HERE / "paged_prefill_brgemm.cpp",
            _HERE / "fused.cpp", _HERE / "kv_write.cpp", _HERE / "linear.cpp",
            _HERE / "quant_linear.cpp", _HERE / "quant_linear_q8.cpp", _HERE / "quant_linear_k8.cpp",
            _HERE / "quant_linear_k8_panel.cpp", _HERE / "quant_linear_x16.cpp",
            _HERE / "layer_stack.cpp",
            _HERE / "group_reduce.cpp", _HERE / "stream_read.cpp"]
# Every header next to the sources: the build directory's key covers whatever they include.
_HEADERS = sorted(_HERE.glob("*.h"))
# -ffp-contract=off: no implicit FMA, so a kernel rounds exactly where its PyTorch fallback does.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-ffp-contract=off",
           *os.environ.get("TANDEM_KERNEL_CFLAGS", "").split()]
# -fopenmp makes at::parallel_for actually parallel; the resulting libgomp.so.1 dependency resolves
# to the copy torch already loaded, so there is one OpenMP runtime and torch.set_num_threads applies.
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded = False
_build_failed: str | None = None  # reason, so a failed build is not retried in this process
_fakes: dict[str, Callable[..., Any]] = {}  # op name -> shape-only implementation for tracing


def kernels_disabled() -> bool:
    return os.environ.get("TANDEM_DISABLE_KERNELS", "").strip().lower() in ("1", "true", "yes", "on")


def _cpu_signature() -> str:
    """The CPU's feature flags: -march=native code must not be loaded on a different CPU (SIGILL),
    e.g. from a cache directory shared between machines."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build_dir() -> Path:
    """Build directory keyed by everything that changes the binary, so a stale build is never loaded."""
    h = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(sys.version.encode())
    h.update(_cpu_signature().encode())
    return cache_dir() / "ext" / f"{EXT_NAME}-{h.hexdigest()[:16]}"


def _library_path(directory: Path) -> Path:
    return directory / f"{EXT_NAME}.so"


def _build(directory: Path) -> Path:
    from torch.utils import cpp_extension

    # ninja lives next to the interpreter in the venv; make it findable without an activated venv.
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    logger.info("building %s in %s (one-time, ~30-60 s)", EXT_NAME, directory)
    cpp_extension.load(
        name=EXT_NAME,
        sources=[str(s) for s in _SOURCES],
        extra_cflags=list(_CFLAGS),  # load() appends to the lists it is given
        extra_ldflags=list(_LDFLAGS),
        extra_include_paths=[str(_HERE)],
        build_directory=str(directory),
        is_python_module=False,  # TORCH_LIBRARY ops: no pybind11, faster to compile
        verbose=False,
    )
    logger.info("built %s in %.1fs", EXT_NAME, time.perf_counter() - t0)
    return _library_path(directory)


def register_fake(name: str, fn: Callable[..., Any]) -> None:
    """Shape-only implementation of torch.ops.tandem.<name>, registered once the library loads,
    so torch.compile / FakeTensor tracing can see through the op."""
    _fakes[name] = fn
    if _loaded:
        _register_fakes()


def _register_fakes() -> None:
    for name, fn in _fakes.items():
        # RuntimeError: already registered (e.g. by a second copy of a module under __main__).
        with contextlib.suppress(RuntimeError):
            torch.library.register_fake(f"tandem::{name}", fn)


def load_extension(build: bool = True) -> bool:
    """Load the compiled ops (building them first if ``build``); False when unavailable.

    An existing build is loaded directly (milliseconds). A failed build logs a warning and is not
    retried within the process; callers then get the PyTorch fallbacks.
    """
    global _loaded, _build_failed
    if kernels_disabled():
        return False
    if _loaded:
        return True
    with _lock:
        if _loaded:
            return True
        if _build_failed is not None:
            return False
        try:
            directory = build_dir()
            lib = _library_path(directory)
            if not lib.exists():
                if not build:
                    return False
                lib = _build(directory)  # cpp_extension.load also loads the library
            if not hasattr(torch.ops.tandem, "paged_decode_attention"):
                torch.ops.load_library(str(lib))
            _loaded = True
            _register_fakes()
        except Exception as e:  # any build/load problem must degrade to the fallback, not crash
            _build_failed = f"{type(e).__name__}: {e}"
            logger.warning("compiled ops unavailable, using the PyTorch fallbacks: %s", _build_failed)
            return False
    return True


def op(name: str) -> Any | None:
    """torch.ops.tandem.<name> when the extension is available, else None."""
    return getattr(torch.ops.tandem, name) if load_extension() else None


def extension_available() -> bool:
    """True when the compiled ops can be used (loads, and builds if needed, on first call)."""
    return load_extension()


_batch_invariant: bool | None = None  # as last set in this process (the kernels' flag is process-wide)


def set_batch_invariant(on: bool) -> None:
    """Switch the kernels' batch-invariant numerics (ops/batch_invariant.h) for this process. Engines
    call it before each step, so engines of both kinds can share a process; a call that changes
    nothing costs no op call."""
    global _batch_invariant
    if on != _batch_invariant and load_extension():
        torch.ops.tandem.set_batch_invariant(on)
        _batch_invariant = on


def batch_invariant() -> bool:
    """Whether the kernels run batch-invariant in this process (as last set; on until an engine says)."""
    return _batch_invariant is not False


def extension_error() -> str | None:
    """Why the extension failed to build or load in this process, if it did."""
    return _build_failed


def extension_isa() -> str | None:
    """Which code path the ops were compiled with: 'avx512-bf16', 'avx512f', 'avx2' (AVX2 + FMA)
    or 'portable'."""
    if not load_extension(build=False):
        return None
    return str(torch.ops.tandem.isa())


def main() -> int:
    """Build (or load) the extension and report; exit status 1 when it is unavailable."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if kernels_disabled():
        print("TANDEM_DISABLE_KERNELS is set; not building")
        return 0
    t0 = time.perf_counter()
    ok = extension_available()
    dt = time.perf_counter() - t0
    if ok:
        print(f"{EXT_NAME}: ready ({extension_isa()}) in {dt:.1f}s at {build_dir()}")
        return 0
    print(f"{EXT_NAME}: unavailable ({extension_error()}); the PyTorch fallbacks will be used")
    return 1

