"""Paged decode attention: a compiled CPU kernel with a pure-PyTorch fallback.

``paged_decode_attention`` is the entry point. It uses the C++ kernel in ``paged_attention.cpp``
(built with ``torch.utils.cpp_extension``) when it is available and the inputs suit it, and
``paged_decode_attention_torch`` otherwise. Build ahead of time with
``python -m tandem.ops.paged_attention`` so nothing compiles on a request's path.

Environment:
  TANDEM_DISABLE_KERNELS=1  always use the PyTorch fallback.
  TANDEM_CACHE_DIR          root of the build cache (default ~/.cache/tandem); builds go to
                            ``$TANDEM_CACHE_DIR/ext/<hash of source, torch version, flags>``.
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
from pathlib import Path
from typing import Any

import torch

from tandem.cache import cache_dir

logger = logging.getLogger(__name__)

EXT_NAME = "tandem_paged_attention"
_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
# -fopenmp makes at::parallel_for actually parallel; the resulting libgomp.so.1 dependency resolves
# to the copy torch already loaded, so there is one OpenMP runtime and torch.set_num_threads applies.
_LDFLAGS = ["-fopenmp"]
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_op: Any = None  # torch.ops.tandem_paged_attention.decode once loaded
_build_failed: str | None = None  # reason, so a failed build is not retried in this process


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
    h.update(_SOURCE.read_bytes())
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
    logger.info("building %s in %s (one-time, ~15-30 s)", EXT_NAME, directory)
    cpp_extension.load(
        name=EXT_NAME,
        sources=[str(_SOURCE)],
        extra_cflags=list(_CFLAGS),  # load() appends to the lists it is given
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,  # TORCH_LIBRARY op: no pybind11, faster to compile
        verbose=False,
    )
    logger.info("built %s in %.1fs", EXT_NAME, time.perf_counter() - t0)
    return _library_path(directory)


def load_kernel(build: bool = True) -> Any | None:
    """Load the compiled op (building it first if ``build``); None when unavailable.

    An existing build is loaded directly (milliseconds). A failed build logs a warning and is not
    retried within the process; callers then get the PyTorch fallback.
    """
    global _op, _build_failed
    if kernels_disabled():
        return None
    if _op is not None:
        return _op
    with _lock:
        if _op is not None:
            return _op
        if _build_failed is not None:
            return None
        try:
            directory = build_dir()
            lib = _library_path(directory)
            if not lib.exists():
                if not build:
                    return None
                lib = _build(directory)  # cpp_extension.load also loads the library
            if not hasattr(torch.ops.tandem_paged_attention, "decode"):
                torch.ops.load_library(str(lib))
            _register_fake()
            _op = torch.ops.tandem_paged_attention.decode
        except Exception as e:  # any build/load problem must degrade to the fallback, not crash
            _build_failed = f"{type(e).__name__}: {e}"
            logger.warning("paged attention kernel unavailable, using the PyTorch fallback: %s",
                           _build_failed)
            return None
    return _op


def _fake_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _register_fake() -> None:
    """Shape-only implementation so torch.compile / FakeTensor tracing can see through the op."""
    # RuntimeError: already registered (e.g. by a second copy of this module under __main__).
    with contextlib.suppress(RuntimeError):
        torch.library.register_fake("tandem_paged_attention::decode", _fake_decode)


def kernel_available() -> bool:
    """True when the compiled kernel can be used (loads, and builds if needed, on first call)."""
    return load_kernel() is not None


def kernel_error() -> str | None:
    """Why the kernel failed to build or load in this process, if it did."""
    return _build_failed


def kernel_isa() -> str | None:
    """Which code path the kernel was compiled with: 'avx512-bf16', 'avx512f' or 'portable'."""
    if load_kernel(build=False) is None:
        return None
    return str(torch.ops.tandem_paged_attention.isa())


def _kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in _SUPPORTED_DTYPES
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and q.shape[-1] % 16 == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and not (torch.is_grad_enabled() and q.requires_grad)  # the kernel has no backward
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V.

    q: [N, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] (same dtype as q, H % KVH == 0);
    block_tables: int32 [N, max_blocks]; seq_lens: int32 [N], each >= 1. Returns [N, H, D] in q's dtype.
    Query head h reads kv head h // (H // KVH). The softmax is computed in float32.
    """
    if _kernel_supports(q, k_cache, v_cache):
        op = load_kernel()
        if op is not None:
            tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)  # no-ops when int32
            return op(q, k_cache, v_cache, tables, lens, float(scale))
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Pure-PyTorch reference path: one padded gather through the block tables, then masked SDPA."""
    n, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    max_blocks = max(1, -(-int(lens.max()) // block_size)) if n else 1
    table = block_tables[:, :max_blocks].to(device=q.device, dtype=torch.long)
    # Entries past a sequence's last block may hold anything (-1, stale ids): point them at block 0.
    blocks_used = (lens + block_size - 1) // block_size
    table = torch.where(torch.arange(max_blocks, device=q.device) < blocks_used[:, None], table, 0)
    length = max_blocks * block_size
    # [N, blocks, BS, KVH, D] -> [N, KVH, L, D]
    k = k_cache[table].reshape(n, length, kvh, d).transpose(1, 2)
    v = v_cache[table].reshape(n, length, kvh, d).transpose(1, 2)
    mask = (torch.arange(length, device=q.device) < lens[:, None])[:, None, None, :]  # [N, 1, 1, L]
    # enable_gqa reads each kv head once for its query group (2x faster than repeat_interleave);
    # SDPA's CPU kernels accumulate the softmax in float32 for bf16 inputs.
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=kvh != h
    )
    return out.squeeze(2)


def main() -> int:
    """Build (or load) the kernel and report; exit status 1 when it is unavailable."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if kernels_disabled():
        print("TANDEM_DISABLE_KERNELS is set; not building")
        return 0
    t0 = time.perf_counter()
    ok = kernel_available()
    dt = time.perf_counter() - t0
    if ok:
        print(f"{EXT_NAME}: ready ({kernel_isa()}) in {dt:.1f}s at {build_dir()}")
        return 0
    print(f"{EXT_NAME}: unavailable ({kernel_error()}); the PyTorch fallback will be used")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
