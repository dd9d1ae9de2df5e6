"""The ``zeroshard`` command line: a thin dispatcher over subcommand modules.

Each module listed in ``SUBCOMMAND_MODULES`` exposes ``COMMANDS``: a dict from subcommand
name to a ``Command`` (help text, ``add_arguments(parser)``, ``run(args) -> exit code``).
Modules are imported only when the command line is parsed, so adding one (``bench``,
``estimate``) is one line here and no import cost elsewhere.

A command with ``one_line_errors`` reports a bad argument or a failure as one line on stderr
(``zeroshard finetune: error: ...``) with exit status 1, and a usage error as one line with
status 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    one_line_errors: bool = False
    """Errors print as one line, not a traceback (``--debug`` shows it)."""


def one_line(text: str) -> str:
    """``text`` on one line (messages that quote a file or an exception may hold newlines)."""
    return " ".join(str(text).split())


def _usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    print(f"{parser.prog}: error: {one_line(message)} (see {parser.prog} --help)", file=sys.stderr)
    sys.exit(2)


def one_line_usage(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Makes ``parser`` report usage errors as one line (no usage block)."""
    parser.error = types.MethodType(_usage_error, parser)  # type: ignore[method-assign]
    return parser


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the Python traceback instead of one line")


def report_error(command: str, exc: BaseException) -> int:
    """Prints ``exc`` as the one line of a failed command; returns the exit status."""
    message = one_line(str(exc)) or type(exc).__name__
    print(f"zeroshard {command}: error: {message}", file=sys.stderr)
    return 1


SUBCOMMAND_MODULES: list[str] = [
    "zeroshard.checkpoint.checkpoint_commands",  # inspect, verify, export
    "zeroshard.train.finetune",  # finetune (torchrun; reruns resume)
    "zeroshard.planner.planner_commands",  # estimate
    "zeroshard.io.io_commands",  # bench (aio; BENCH_MODULES there adds memory/step)
    "zeroshard.deepspeed_compat.convert",  # convert-deepspeed
]


def build_parser(modules: Sequence[str] = tuple(SUBCOMMAND_MODULES)) -> argparse.ArgumentParser:
    parser = one_line_usage(argparse.ArgumentParser(prog="zeroshard", description="zeroshard: ZeRO training tools"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in modules:
        commands: dict[str, Command] = importlib.import_module(module).COMMANDS
        for name, cmd in commands.items():
            p = sub.add_parser(name, help=cmd.help, description=cmd.help)
            if cmd.one_line_errors:
                one_line_usage(p)
                add_debug_flag(p)
            cmd.add_arguments(p)
            p.set_defaults(_run=cmd.run, _one_line=cmd.one_line_errors)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "_one_line", False) or getattr(args, "debug", False):
        return int(args._run(args) or 0)
    try:
        return int(args._run(args) or 0)
    except Exception as exc:  # noqa: BLE001 - the one line of a failed command (--debug: the traceback)
        return report_error(" ".join(filter(None, (args.command, getattr(args, "bench_action", None)))), exc)


if __name__ == "__main__":
    sys.exit(main())
