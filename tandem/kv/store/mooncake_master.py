"""Mooncake's availability here, and a local master for tests and single-host users.

``mooncake_available()`` says why Mooncake cannot be used (the package, a shared library it links,
or the ``mooncake_master`` binary is missing); ``start_local_master`` runs a master on 127.0.0.1
only (RPC and the metrics/admin port; no HTTP metadata server: clients use ``P2PHANDSHAKE``).
``python -m tandem.kv.store.mooncake_master [PORT]`` runs one until interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGE = "mooncake-transfer-engine-non-cuda"
# Shared libraries the wheel's binaries link but do not ship, and the Debian packages that have them.
_DEBIAN_PACKAGES = {
    "libibverbs.so.1": "libibverbs1", "librdmacm.so.1": "librdmacm1", "libnuma.so.1": "libnuma1",
    "liburing.so.2": "liburing2", "libcurl.so.4": "libcurl4",
}


def _missing_library(message: str) -> str | None:
    m = re.search(r"([\w.+-]+\.so[\w.]*)[^\n]*(?:cannot open shared object file|not found)", message)
    if not m:
        return None
    lib = m.group(1)
    pkg = _DEBIAN_PACKAGES.get(lib)
    return f"a shared library Mooncake needs is missing: {lib}" + (f" (Debian: apt-get install {pkg})" if pkg else "")


def import_store():  # noqa: ANN202 (the mooncake.store module; imported lazily, it is optional)
    """mooncake.store, or RuntimeError with the reason it cannot be imported."""
    if importlib.util.find_spec("mooncake") is None:
        raise RuntimeError(f"{PACKAGE} is not installed (pip install 'tandem[mooncake]')")
    try:
        import mooncake.store as store
    except (ImportError, OSError) as e:
        raise RuntimeError(_missing_library(str(e)) or f"mooncake.store does not import: {e}") from e
    return store


def master_binary() -> str | None:
    """The ``mooncake_master`` executable the wheel ships (inside the package), else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / "mooncake_master"
            if path.is_file():
                if not os.access(path, os.X_OK):
                    with contextlib.suppress(OSError):
                        path.chmod(path.stat().st_mode | 0o111)
                return str(path)
    return shutil.which("mooncake_master")


@functools.cache
def mooncake_available(need_master: bool = True) -> str | None:
    """None when Mooncake can be used here (the client imports and, with need_master, the master
    binary runs), else the reason: the package is missing, a shared library is, or the binary is."""
    try:
        import_store()
    except RuntimeError as e:
        return str(e)
    if not need_master:
        return None
    binary = master_binary()
    if binary is None:
        return f"the mooncake_master binary is not in the {PACKAGE} package nor on PATH"
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{binary} does not run: {e}"
    if done.returncode != 0:
        out = (done.stderr or done.stdout).strip()
        return _missing_library(out) or f"{binary} --version exited {done.returncode}: {out[-300:]}"
    return None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_local_master(port: int | None = None, *, timeout_s: float = 20.0, extra_args: tuple[str, ...] = (),
                       log_path: str | os.PathLike[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``mooncake_master`` on 127.0.0.1 (RPC on port, a free one if None; its metrics/admin
    port on another free loopback port; no HTTP metadata server) and wait until it accepts
    connections. Returns the process and its ``mooncake://127.0.0.1:PORT`` URL; stop it with
    ``stop_local_master`` (else it is stopped when this interpreter exits). Its log goes to log_path
    (else to an unnamed temporary file, whose tail is in the error if it does not start). RuntimeError
    when it cannot be started."""
    reason = mooncake_available()
    if reason is not None:
        raise RuntimeError(f"Mooncake is not usable: {reason}")
    binary = master_binary()
    assert binary is not None
    host = "127.0.0.1"
    rpc_port = port or _free_port(host)
    metrics_port = _free_port(host)
    while metrics_port == rpc_port:
        metrics_port = _free_port(host)
    args = [binary, f"--rpc_address={host}", f"--rpc_port={rpc_port}",
            f"--metrics_host={host}", f"--metrics_port={metrics_port}", "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false", *extra_args]
    logf = open(log_path, "ab") if log_path is not None else tempfile.TemporaryFile()  # noqa: SIM115
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    except OSError:
        logf.close()
        raise
    proc._tandem_log = logf  # type: ignore[attr-defined]  # closed by stop_local_master
    atexit.register(stop_local_master, proc)  # not left running by a caller that exits without stopping it

    def failed(why: str) -> RuntimeError:
        stop_local_master(proc)
        tail = ""
        with contextlib.suppress(OSError, ValueError):
            logf.flush()
            logf.seek(0)
            tail = logf.read()[-2000:].decode(errors="replace").strip()
        with contextlib.suppress(OSError):
            logf.close()
        return RuntimeError(f"mooncake_master {why}" + (f"; its log ends:\n{tail}" if tail else ""))

    deadline = time.monotonic() + timeout_s
    while not accepts(host, rpc_port, 0.5):
        if proc.poll() is not None:
            raise failed(f"exited with status {proc.returncode} (port {rpc_port} taken?)")
        if time.monotonic() > deadline:
            raise failed(f"did not accept connections on {host}:{rpc_port} within {timeout_s:g} s")
        time.sleep(0.05)
    return proc, f"mooncake://{host}:{rpc_port}"


def stop_local_master(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate a master from start_local_master (SIGKILL if it does not exit in timeout_s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logf = getattr(proc, "_tandem_log", None)
    if logf is not None:
        with contextlib.suppress(OSError):
            logf.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tandem.kv.store.mooncake_master [PORT]``: run a master on 127.0.0.1 until interrupted."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the master on a plain kill too
    try:
        proc, url = start_local_master(int(args[0]) if args else None)
    except (RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    print(url, flush=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop_local_master(proc)


if __name__ == "__main__":
    raise SystemExit(main())
