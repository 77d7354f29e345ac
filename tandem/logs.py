"""Logging for every Tandem process: text for people, or one JSON object a line (`--log-format json`)
for a log pipeline. The format travels to child processes (the engine core, local workers) in
the environment, so a deployment's processes all log the same way.

Start-up progress goes to the `tandem.startup` logger, shown at INFO even under the default
WARNING level: someone who runs `tandem serve` sees what it is doing while it loads."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

FORMAT_ENV = "TANDEM_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
startup = logging.getLogger("tandem.startup")

# LogRecord's own attributes; anything else on a record came in `extra=` and is a structured field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                 "level": record.levelname.lower(), "process": self.process, "pid": record.process,
                 "logger": record.name, "msg": record.getMessage()}
        entry |= {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(level: str = "WARNING", fmt: str | None = None, process: str = "tandem") -> None:
    """Configure this process's root logger. fmt None: the one the parent process chose, else text."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s %(levelname)s {process}: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Progress is shown unless the user asked for less than warnings.
    startup.setLevel(min(logging.INFO, root.level) if root.level <= logging.WARNING else root.level)
