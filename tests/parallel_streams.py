"""The suite in parallel streams (pytest-xdist, `scripts/test` starts one per core): each stream on a core of
its own, and a test marked `whole_machine` alone on every core.

Why a core each: two-thread PyTorch runs 10-50x slower while another process competes for its cores
(its OpenMP threads wait on each other at every barrier), so two streams sharing both cores would
each slow the other. Pinned, every stream is a machine of one core, and what it starts inherits that:
`tandem serve` and its workers place themselves on the cores they may use, torch takes one thread.
What only a whole machine can check (timing the co-location of two cores, fitting collectives
across them) is marked `whole_machine`: its stream waits until no other test runs, widens to every
core for it and narrows again after, while the other streams wait. (What such a test starts for later
tests, a module's or the session's shared server, would keep every core: the marked tests share none.)

Without xdist (PYTEST_XDIST_WORKER unset) nothing here changes anything.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... in a stream
ALL_CORES = sorted(os.sched_getaffinity(0))


def own_core() -> None:
    """Pin this stream to its core: called before torch is imported, so its OpenMP pool has one thread."""
    if WORKER:
        os.sched_setaffinity(0, {ALL_CORES[int(WORKER.removeprefix("gw")) % len(ALL_CORES)]})


def _lock_path(name: str) -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "serial")  # the same in every stream of one run
    return Path(tempfile.gettempdir()) / f"tandem-tests-{os.getuid()}" / f"streams-{run}.{name}"


@contextmanager
def _flock(name: str, mode: int) -> Iterator[None]:
    path = _lock_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def one_stream_at_a_time(name: str) -> Iterator[None]:
    """Around what the machine can hold one of at a time (a local Ray cluster: `ray stop` stops every
    one), where a module's tests may be split between streams."""
    with _flock(name, fcntl.LOCK_EX):
        yield


@contextmanager
def machine_share(whole: bool) -> Iterator[None]:
    """Around one test (its fixtures' set-up and teardown included). Every test holds the `run` lock
    shared; a whole-machine test holds it alone. It first takes the `gate`, which every test passes
    through before it starts, so the streams stop starting tests while it waits (a writer is not
    starved by a stream of short readers)."""
    if not WORKER:
        yield
        return
    if not whole:
        with _flock("gate", fcntl.LOCK_SH):
            pass
        with _flock("run", fcntl.LOCK_SH):
            yield
        return
    import torch

    own, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with _flock("gate", fcntl.LOCK_EX), _flock("run", fcntl.LOCK_EX):
        os.sched_setaffinity(0, ALL_CORES)
        torch.set_num_threads(len(ALL_CORES))
        try:
            yield
        finally:
            os.sched_setaffinity(0, own)
            torch.set_num_threads(threads)
