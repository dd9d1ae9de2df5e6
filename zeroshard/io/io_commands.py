"""``zeroshard bench``: the command group, and its ``aio`` action (measure a disk, recommend
block size and queue depth).

``bench`` is one group: each module in ``BENCH_MODULES`` exposes ``BENCH_COMMANDS`` (action
name -> ``Command``), so an action (``bench memory``, ``bench step``) joins with one line in
that list; argparse refuses two top-level commands of the same name, hence one owner.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys

from zeroshard.cli import Command, add_debug_flag, one_line_usage
from zeroshard.io.aio_config import ALIGN

BENCH_MODULES: list[str] = [
    "zeroshard.io.io_commands",  # aio
    "zeroshard.bench.bench_commands",  # memory, step
    "zeroshard.bench.link_commands",  # link
]

MiB = 1 << 20


def _size(text: str) -> int:
    """Bytes from "4096", "8M", "8MiB", "1G", "1GB" (binary units): a positive whole number."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 1 << 10, "m": MiB, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
        if not 0 < value < 1 << 60 or value != int(value):
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size in bytes; use e.g. 4096, 8M or 1G") \
            from None


def _block_sizes(text: str) -> list[int]:
    sizes = [_size(s) for s in text.split(",") if s.strip()]
    bad = [s for s in sizes if s % ALIGN]
    if not sizes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated block sizes, each a multiple of {ALIGN} "
                                         "bytes, e.g. 1M,4M")
    return sizes


def _depths(text: str) -> list[int]:
    try:
        depths = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1 or max(depths) > 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated queue depths from 1 to 1024, e.g. 4,16")
    return depths


def _aio_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", required=True, help="directory on the disk to measure (a temporary file is written there)")
    p.add_argument("--size", type=_size, default=1 << 30, help="bytes per measurement, e.g. 1G (default 1G)")
    p.add_argument("--block-sizes", type=_block_sizes, default="1M,4M,8M,16M",
                   help="comma-separated block sizes to try")
    p.add_argument("--queue-depths", type=_depths, default="4,8,16,32", help="comma-separated queue depths to try")
    p.add_argument("--backend", default="auto", choices=("auto", "native", "python"))
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _aio(args: argparse.Namespace) -> int:
    from zeroshard.io.bench import recommend, sweep
    from zeroshard.io.status import engine_status

    if not os.path.isdir(args.path):
        print(f"--path {args.path!r} is not a directory; create it or pass a directory on the disk to measure",
              file=sys.stderr)
        return 2
    block_sizes, depths = args.block_sizes, args.queue_depths
    chunk = min(256 * MiB, args.size)
    free = shutil.disk_usage(args.path).free
    if args.size % chunk or args.size % ALIGN or args.size > free // 2:
        print(f"--size {args.size} must be a multiple of {ALIGN if args.size % ALIGN else chunk} and at most half "
              f"the free space ({free} bytes)", file=sys.stderr)
        return 2
    status = engine_status()
    if not args.json:
        print(f"backend: {status['backend']} ({status['native']['reason']}); {args.size / 1e9:.2f} GB per point")
        print(f"{'block':>8s} {'qd':>4s} {'write GB/s':>11s} {'read GB/s':>10s}")

    def show(p) -> None:
        if not args.json:
            print(f"{p.block_size // 1024:>7d}K {p.queue_depth:>4d} {p.write_gbps:>11.2f} {p.read_gbps:>10.2f}", flush=True)

    points = sweep(args.path, args.size, block_sizes, depths, backend=args.backend, chunk_bytes=chunk, progress=show)
    best = recommend(points)
    if args.json:
        print(json.dumps({"points": [p.__dict__ for p in points], "recommended": best.__dict__,
                          "status": status}, indent=1))
    else:
        print(f"recommended: AsyncIO(block_size={best.block_size}, queue_depth={best.queue_depth})  "
              f"# {best.block_size // MiB} MiB x {best.queue_depth}: write {best.write_gbps:.2f} GB/s, "
              f"read {best.read_gbps:.2f} GB/s (the smallest in-flight size within 5% of the best both ways)")
    return 0


BENCH_COMMANDS: dict[str, Command] = {
    "aio": Command("measure async file I/O on a disk; recommend block size and queue depth", _aio_args, _aio),
}


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_action", metavar="ACTION")
    sub.required = True
    for module in BENCH_MODULES:
        try:
            commands: dict[str, Command] = importlib.import_module(module).BENCH_COMMANDS
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real import error inside the module: show it
                raise
            continue  # a listed module not shipped in this installation
        for name, cmd in commands.items():
            q = one_line_usage(sub.add_parser(name, help=cmd.help, description=cmd.help))
            add_debug_flag(q)
            cmd.add_arguments(q)
            q.set_defaults(_run=cmd.run)  # argparse copies an action's defaults over the group's


COMMANDS: dict[str, Command] = {
    # The group's own run is never called: the chosen action's `_run` default replaces it.
    "bench": Command("benchmarks: " + ", ".join(f"`bench {n}`" for n in ("aio", "memory", "step", "link")),
                     _bench_args, lambda args: args._run(args), one_line_errors=True),
}
