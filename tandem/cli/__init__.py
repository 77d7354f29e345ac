"""`tandem generate | serve | worker | bench | profile | plan`: one module per command."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from tandem import logs
from tandem.bench.cli import BenchHelpFormatter, add_bench_parser
from tandem.cli.generate import add_generate_parser
from tandem.cli.serve import add_serve_command
from tandem.cli.worker import add_worker_parser
from tandem.process_exit import exit_now
from tandem.sim.cli import add_plan_parser, add_profile_parser, add_sim_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference server")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_command(sub)
    add_worker_parser(sub)
    # `bench sim` lives with the simulator, a layer above the benchmark client that it drives.
    add_sim_parser(add_bench_parser(sub), BenchHelpFormatter)
    add_profile_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    process = {"serve": "api", "worker": getattr(args, "worker_id", None) or f"{getattr(args, 'role', '')}-worker"}
    logs.setup(args.log_level, getattr(args, "log_format", None), process.get(args.command, args.command))
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> NoReturn:
    """The `tandem` command (and `python -m tandem.cli`, how deployments start their processes): main(),
    then an exit without the interpreter's teardown (tandem/process_exit.py), which made every server
    and worker stop 0.2-0.4 s later. main() stays an ordinary function for callers in a process of their own."""
    exit_now(main())
