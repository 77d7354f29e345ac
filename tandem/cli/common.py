"""Flags every long-running command shares."""

from __future__ import annotations

import argparse

from tandem.logs import LOG_FORMATS


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                   help="text for people (default), or json: one object a line with ts, level, process, msg "
                        "and the event's fields; the deployment's child processes log the same way")
