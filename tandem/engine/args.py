"""Engine options as command-line flags, named as vLLM names them, and back.

Each flag is declared once, on its settings field (config.py's `flag(...)`: default, help, choices);
the parser (add_engine_args), a worker's command line (engine_argv), the keyword arguments an engine
is built from (engine_kwargs) and the docs' flag table (flag_table, in docs/serving.md) all read that
declaration. Every command that starts an engine (serve, worker, profile, a Ray actor) reads the same
flags, and a process that starts workers hands its own on as a command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

from tandem.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tandem.flags import Flag

# The settings whose flagged fields are engine flags, in the order --help lists them.
ENGINE_SECTIONS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig)
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def engine_flags(sections: Sequence[type] = ENGINE_SECTIONS) -> list[tuple[Field, Flag]]:
    """Every flagged field of the sections, with its declaration."""
    return [(f, f.metadata["flag"]) for section in sections for f in fields(section) if "flag" in f.metadata]


def _dest(f: Field, how: Flag) -> str:
    return how.name or f.name


def _value_type(f: Field) -> type:
    """int, float, str or bool from the field's annotation ("int | None" is int); a setting whose flag
    takes text it parses itself (the speculative config's JSON) is str."""
    return _TYPES.get(str(f.type).split("|")[0].strip(), str)


def _default(f: Field, how: Flag) -> Any:
    return None if how.unset is not None or f.default is MISSING else f.default


def add_engine_args(p: argparse.ArgumentParser, sections: Sequence[type] = ENGINE_SECTIONS) -> None:
    """Engine options as flags, named as vLLM names them."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, how in engine_flags(sections):
        target = p if how.group is None else groups.setdefault(how.group, p.add_argument_group(how.group))
        kind, default = _value_type(f), _default(f, how)
        if how.positional:
            target.add_argument(f.name, nargs="?", default=default, help=how.help)
            continue
        names = ["--" + _dest(f, how).replace("_", "-")] + ([how.short] if how.short else [])
        options: dict[str, Any] = {"default": default, "help": how.help or None, "dest": _dest(f, how)}
        if how.metavar:
            options["metavar"] = how.metavar
        if kind is bool:
            target.add_argument(*names, action=argparse.BooleanOptionalAction, **options)
        else:
            target.add_argument(*names, type=kind, choices=list(how.choices) if how.choices else None, **options)


def engine_dests(sections: Sequence[type] = ENGINE_SECTIONS) -> tuple[str, ...]:
    """The options' names (the model's excepted), as engine_kwargs returns them."""
    return tuple(_dest(f, how) for f, how in engine_flags(sections) if not how.positional)


ENGINE_DESTS = engine_dests()


def engine_kwargs(args: argparse.Namespace, sections: Sequence[type] = ENGINE_SECTIONS) -> dict:
    """The engine options of args (parsed by a parser add_engine_args built), by name."""
    return {dest: getattr(args, dest) for dest in engine_dests(sections)}


def engine_argv(args: argparse.Namespace, sections: Sequence[type] = ENGINE_SECTIONS) -> list[str]:
    """The engine flags of args, as a command line (for workers started from this process)."""
    argv = [args.model] if args.model else []
    for key, value in engine_kwargs(args, sections).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def flag_table(sections: Sequence[type] = ENGINE_SECTIONS) -> str:
    """The engine flags as docs/serving.md lists them (a Markdown table; tests/test_engine_args.py checks
    the page holds this one)."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for f, how in engine_flags(sections):
        if how.positional:
            name, default = f"`{f.name.upper()}`", "SmolLM2-135M-Instruct"
        else:
            name = "`--" + _dest(f, how).replace("_", "-") + "`" + (f" (`{how.short}`)" if how.short else "")
            default = how.unset if how.unset is not None else \
                ("on" if f.default else "off") if isinstance(f.default, bool) else f"`{f.default}`"
        meaning = how.help + (f" ({', '.join(how.choices)})" if how.choices else "")
        rows.append(f"| {name} | {default} | {meaning.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


TABLE_START = "<!-- engine flags: generated from the settings' declarations by scripts/flag_table.py -->"
TABLE_END = "<!-- end of the engine flags -->"


def with_flag_table(page: str, sections: Sequence[type] = ENGINE_SECTIONS) -> str:
    """The page with the table between its markers made from the declarations."""
    head, rest = page.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{flag_table(sections)}{TABLE_END}{tail}"
