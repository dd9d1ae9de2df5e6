"""``zeroshard bench link``: stage-3 sharding scopes over a shaped link between network
namespaces on this machine (root only), writing Markdown, CSV and JSON into ``--out``."""
from __future__ import annotations

import argparse
import sys

from zeroshard.cli import Command


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="TinyGPT preset (tiny, small, medium, large)")
    p.add_argument("--d-model", type=int, default=0, help="override the preset's width")
    p.add_argument("--layers", type=int, default=0, help="override the preset's depth")
    p.add_argument("--rates", default="10,2.5,1", help="link rates in Gbit/s, comma-separated (0: unshaped)")
    p.add_argument("--delays", default="0", help="one-way delays in ms, comma-separated (needs the netem qdisc)")
    p.add_argument("--nodes", type=int, default=2, help="namespaces (2: a veth pair; more: a bridge)")
    p.add_argument("--per-node", type=int, default=2, help="ranks per namespace")
    p.add_argument("--config", action="append", default=[], metavar="[LABEL=]SCOPE[:JSON]",
                   help="a configuration besides the baseline flat stage 3 (repeatable; default: hybrid, hpz); "
                   "SCOPE is flat, hybrid or hpz, JSON extra ZeroOptimizer kwargs")
    p.add_argument("--zero-kwargs", default=None, metavar="JSON",
                   help="ZeroOptimizer kwargs for every configuration but the baseline, e.g. "
                   "'{\"mixed_precision\": \"bf16\"}'")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job (one link point) may take")
    p.add_argument("--out", default="bench-results", help="directory for link.md, link.csv, link.json")
    p.set_defaults(bench_action="link")


def _run(a: argparse.Namespace) -> int:
    from zeroshard.bench import netns_bench
    from zeroshard.bench.bench_commands import _write
    from zeroshard.bench.netns_link import unavailable

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress to stderr, tables to stdout
    try:
        model = {"name": a.model, "d_model": a.d_model, "layers": a.layers}
        from zeroshard.bench.models import ModelSource
        ModelSource.parse(a.model, d_model=a.d_model, n_layers=a.layers)  # (refuses a bad model before any setup)
        bench = netns_bench.LinkBench(
            model=model, configs=netns_bench.configurations(a.config or ["hybrid", "hpz"], a.zero_kwargs),
            rates_gbit=_floats(a.rates),
            delays_ms=_floats(a.delays), nodes=a.nodes, per_node=a.per_node, steps=a.steps, rounds=a.rounds,
            global_batch=a.global_batch, timeout_s=a.timeout)
    except ValueError as exc:
        print(f"zeroshard bench link: {exc}", file=sys.stderr)
        return 2
    why = unavailable()
    if why:
        print(f"zeroshard bench link: cannot run here: {why}", file=sys.stderr)
        return 2
    try:
        result = netns_bench.run(bench, log)
    except RuntimeError as exc:
        print(f"zeroshard bench link: {exc}", file=sys.stderr)
        return 1
    text = netns_bench.report_markdown(result)
    _write(a.out, "link", text, result)
    print(text)
    return 0


BENCH_COMMANDS: dict[str, Command] = {
    "link": Command("stage-3 flat vs hybrid vs hpZ (and any ZeroOptimizer kwargs) over a rate/delay-shaped link "
                    "between network namespaces on this machine (root)", _link_args, _run),
}
