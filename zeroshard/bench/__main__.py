"""``python -m zeroshard.bench memory|step|link ...``: the same commands as ``zeroshard bench``,
reachable without the CLI's command group (scripts, the GPU check)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from zeroshard.bench.bench_commands import BENCH_COMMANDS
from zeroshard.bench.link_commands import BENCH_COMMANDS as LINK_COMMANDS


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroshard.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", metavar="WHAT")
    sub.required = True
    for name, cmd in {**BENCH_COMMANDS, **LINK_COMMANDS}.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":  # spawn re-imports the main module in every rank: keep the guard
    sys.exit(main())
