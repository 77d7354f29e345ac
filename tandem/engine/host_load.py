"""How busy other processes keep this process's cores, from /proc/stat: the start-up step profile
waits for them to go quiet before it times anything.

A server's engine starts beside its API process, which imports its web stack and loads the tokenizer
at the same moment; on two cores, a two-thread step timed meanwhile took 2-3x as long as it does once
serving (Zen 3: a one-row decode step profiled at 40 ms against 13-15 ms of TPOT served). The profile
is kept per machine and code (step_time_cache.py), so one contended start misled admission on every
later start too.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

QUIET_SHARE = 0.10  # others may use this share of our cores' time and still count as quiet
WINDOW_S = 0.25
MAX_WAIT_S = 15.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cores: set[int]) -> int | None:
    """The cores' busy time (user, nice, system, irq, softirq) since boot, in clock ticks; None
    where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
            total += user + nice + system + irq + softirq
    return total


def _own_ticks() -> int:
    t = os.times()
    return round((t.user + t.system) * _TICK)


def others_share(window_s: float = WINDOW_S) -> float | None:
    """The share of this process's cores that other processes kept busy over window_s (0 to 1)."""
    cores = os.sched_getaffinity(0)
    before, own_before = _busy_ticks(cores), _own_ticks()
    time.sleep(window_s)
    after, own_after = _busy_ticks(cores), _own_ticks()
    if before is None or after is None:
        return None
    others = (after - before) - (own_after - own_before)
    return max(0.0, others / (window_s * _TICK * len(cores)))


def wait_until_quiet(max_wait_s: float = MAX_WAIT_S, share: float = QUIET_SHARE) -> float:
    """Sleep until other processes use at most `share` of this process's cores over a window, or
    max_wait_s passed (a host that stays busy is what it is: then its steps are timed busy); the
    seconds waited."""
    start = time.monotonic()
    while True:
        busy = others_share()
        waited = time.monotonic() - start
        if busy is None or busy <= share:
            return waited
        if waited >= max_wait_s:
            log.info("other processes keep %.0f%% of this engine's cores busy: timing its steps anyway", busy * 100)
            return waited
