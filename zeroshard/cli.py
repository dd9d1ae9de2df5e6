"""The ``zeroshard`` command line: a thin dispatcher over subcommand modules.

Each module listed in ``SUBCOMMAND_MODULES`` exposes ``COMMANDS``: a dict from subcommand
name to a ``Command`` (help text, ``add_arguments(parser)``, ``run(args) -> exit code``).
Modules are imported only when the command line is parsed, so adding one (``bench``,
``estimate``) is one line here and no import cost elsewhere.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMAND_MODULES: list[str] = [
    "zeroshard.checkpoint.commands",  # inspect, verify, export
    "zeroshard.train.finetune",  # finetune (torchrun; reruns resume)
    "zeroshard.planner.commands",  # estimate
    "zeroshard.io.commands",  # bench (aio; BENCH_MODULES there adds memory/step)
]


def build_parser(modules: Sequence[str] = tuple(SUBCOMMAND_MODULES)) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="zeroshard: ZeRO training tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in modules:
        commands: dict[str, Command] = importlib.import_module(module).COMMANDS
        for name, cmd in commands.items():
            p = sub.add_parser(name, help=cmd.help, description=cmd.help)
            cmd.add_arguments(p)
            p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
