"""The CPU's model name, as /proc/cpuinfo gives it: named with every measurement, and part of the keys of
what is measured once per machine."""

from __future__ import annotations

import platform


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
