"""``zeroshard bench memory`` and ``zeroshard bench step``, writing Markdown, CSV, JSON and
(memory) a PNG chart into ``--out``.

``bench`` is a command group owned by ``zeroshard.io.io_commands``; this module's
``BENCH_COMMANDS`` join it through that module's ``BENCH_MODULES`` list."""
from __future__ import annotations

import argparse
import json
import os
import sys

from zeroshard.cli import Command


def _model_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--model", default=default,
                   help="TinyGPT preset (tiny, small, medium, large) or a Hugging Face config.json path")
    p.add_argument("--d-model", type=int, default=0, help="override the preset's width")
    p.add_argument("--layers", type=int, default=0, help="override the preset's depth")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the preset's, or 64)")
    p.add_argument("--out", default="bench-results", help="directory for the .md, .csv, .json (and .png)")


def _memory_args(m: argparse.ArgumentParser) -> None:
    _model_args(m, "medium")
    m.add_argument("--configs", default=None, help="comma-separated STAGE[+OPTIMIZER_OFFLOAD[+PARAMS_OFFLOAD]] (default "
                   "0,1,2,3,2+cpu,2+nvme,3+cpu+cpu,3+nvme+cpu)")
    m.add_argument("--world-sizes", default="1,2,4")
    m.add_argument("--steps", type=int, default=2)
    m.add_argument("--global-batch", type=int, default=4)
    m.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None)
    m.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    m.set_defaults(bench_action="memory")


def _step_args(s: argparse.ArgumentParser) -> None:
    _model_args(s, "large")
    s.add_argument("--configs", default=None, help="comma-separated trainer names (default: all)")
    s.add_argument("--world-size", type=int, default=2)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--global-batch", type=int, default=8)
    s.set_defaults(bench_action="step")


def _write(out: str, name: str, markdown: str, result: dict) -> None:
    from zeroshard.bench import tables

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out, f"{name}.csv"), "w") as f:
        f.write(tables.csv_text(result["rows"]))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)


def _run(a: argparse.Namespace) -> int:
    from zeroshard.bench.models import ModelSource

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress to stderr, tables to stdout
    try:
        source = ModelSource.parse(a.model, d_model=a.d_model, n_layers=a.layers, seq_len=a.seq_len)
        if a.bench_action == "memory":
            from zeroshard.bench import memory_bench as memory
            from zeroshard.bench.configs import DEFAULT_CONFIGS, MemConfig

            configs = tuple(MemConfig.parse(c) for c in (a.configs or DEFAULT_CONFIGS).split(","))
            memory_bench = memory.MemoryBench(source, configs, tuple(int(w) for w in a.world_sizes.split(",")),
                                              a.steps, a.global_batch, a.mixed_precision)
        else:
            from zeroshard.bench import step

            step_bench = step.StepBench(source, tuple(a.configs.split(",")) if a.configs else step.DEFAULT_KINDS,
                                        a.world_size, a.rounds, a.steps, a.global_batch)
    except ValueError as exc:
        print(f"zeroshard bench {a.bench_action}: {exc}", file=sys.stderr)
        return 2
    if a.bench_action == "memory":
        result = memory.run(memory_bench, log)
        text = memory.report_markdown(result)
        _write(a.out, "memory", text, result)
        if not a.no_chart:
            from zeroshard.bench.chart import memory_chart

            path = memory_chart(result["rows"], os.path.join(a.out, "memory.png"),
                                f"{result['model']}: model states per rank ({result['mixed_precision']})")
            text += f"\n\nchart: {path}"
    else:
        result = step.run(step_bench, log)
        text = step.report_markdown(result)
        _write(a.out, "step", text, result)
    print(text)
    return 0 if all(c["passed"] for c in result["checks"]) else 1


BENCH_COMMANDS: dict[str, Command] = {
    "memory": Command("per-rank memory by category for each stage and world size, vs the ZeRO formulas "
                      "and the planner", _memory_args, _run),
    "step": Command("step time and memory per rank: zeroshard vs DDP, ZeroRedundancyOptimizer, FSDP2, "
                    "DeepSpeed", _step_args, _run),
}
