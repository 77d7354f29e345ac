"""The start-up profile's wait for a quiet host (engine/host_load.py): another process spinning on this
process's cores is seen, and the wait ends once it stops, not before."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from tandem.engine.host_load import others_share, wait_until_quiet

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def _spinner(seconds: float) -> subprocess.Popen[bytes]:
    """A process that keeps one of this process's cores busy for `seconds`."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)])
    os.sched_setaffinity(proc.pid, [min(os.sched_getaffinity(0))])
    return proc


def test_a_process_spinning_on_our_cores_counts_and_our_own_work_does_not() -> None:
    cores = len(os.sched_getaffinity(0))
    quiet = others_share(0.5)
    assert quiet is not None  # /proc/stat is readable on Linux
    proc = _spinner(3.0)
    try:
        time.sleep(0.2)  # started
        busy = others_share(0.5)
    finally:
        proc.kill()
        proc.wait()
    assert busy is not None and busy > quiet + 0.5 / cores, (quiet, busy)  # one core of ours, nearly whole

    def spin() -> None:  # a thread of this process (as an engine's own threads spin) is not another process
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    own = others_share(0.5)
    thread.join()
    assert own is not None and own < busy - 0.3 / cores, (own, busy)


def test_the_wait_lasts_as_long_as_the_neighbour_spins() -> None:
    proc = _spinner(1.5)
    try:
        time.sleep(0.2)
        waited = wait_until_quiet(max_wait_s=10)
    finally:
        proc.kill()
        proc.wait()
    assert 1.0 < waited < 5.0, waited
    proc = _spinner(5.0)
    try:
        time.sleep(0.2)
        capped = wait_until_quiet(max_wait_s=0.5)  # a host that stays busy is timed busy, not waited for
    finally:
        proc.kill()
        proc.wait()
    assert 0.5 <= capped < 1.5, capped
