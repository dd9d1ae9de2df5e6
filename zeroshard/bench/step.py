"""``zeroshard bench step``: seconds per step and memory per rank, zeroshard vs its peers.

Every configuration trains the same model on the same global batch in fresh processes, once
per round; rounds interleave the configurations so that machine noise (other jobs, thermal
state) hits all of them alike, and the figures are medians over all rounds. Ratios are
against single-process ``AdamW(fused=True)`` and against DDP, all from this one session.
A peer that cannot run here is reported with the reason, not dropped silently.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

from zeroshard.bench import tables
from zeroshard.bench.memory_bench import machine
from zeroshard.bench.models import ModelSource
from zeroshard.bench.peers import PEERS
from zeroshard.bench.step_worker import worker
from zeroshard.testing.launch import spawn

DEFAULT_KINDS = ("single", "zeroshard_stage1", "zeroshard_stage2", "zeroshard_stage3", "ddp", "ddp_zero1",
                 "fsdp2", "fsdp2_reshard", "deepspeed_stage2")
STAGE2_SLOWDOWN_LIMIT = 1.10


@dataclass(frozen=True)
class StepBench:
    source: ModelSource
    kinds: tuple[str, ...] = DEFAULT_KINDS
    world_size: int = 2
    rounds: int = 3
    steps: int = 4
    global_batch: int = 8

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in PEERS]
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; choose from {', '.join(PEERS)}")
        if self.rounds < 1 or self.steps < 1 or self.world_size < 1:
            raise ValueError(f"rounds={self.rounds}, steps={self.steps}, world_size={self.world_size} must be >= 1")
        if self.global_batch % self.world_size:
            raise ValueError(f"global batch {self.global_batch} does not split over world size {self.world_size}")


def _reason(exc: BaseException) -> str:
    """The last meaningful line of a rank's traceback: what a reader needs to know why."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip() and not ln.startswith("---")]
    return (lines[-1] if lines else type(exc).__name__)[:240].replace("|", "/")


def run(bench: StepBench, log: Callable[[str], None] = print) -> dict:
    times: dict[str, list[float]] = {k: [] for k in bench.kinds}
    memory: dict[str, int] = {}
    rss: dict[str, int] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(bench.rounds):
            for kind in bench.kinds:
                if kind in failures:
                    continue
                out = os.path.join(tmp, f"{kind}.json")
                world = 1 if kind == "single" else bench.world_size
                try:
                    spawn(worker, world, bench.source, kind, bench.steps, bench.global_batch, out)
                    with open(out) as f:
                        r = json.load(f)
                except Exception as exc:  # a peer that cannot run here is reported, not fatal
                    failures[kind] = _reason(exc)
                    log(f"round {rnd} {kind}: could not run: {failures[kind]}")
                    continue
                times[kind] += r["times"]
                memory[kind], rss[kind] = r["memory"], r["peak_rss"]
                log(f"round {rnd} {kind}: median {statistics.median(r['times']):.3f}s")
    rows: list[dict[str, object]] = []  # (a failed peer's row: its config and the error)
    medians = {k: statistics.median(v) for k, v in times.items() if v}
    for kind in bench.kinds:
        if kind in failures:
            rows.append({"config": kind, "error": failures[kind]})
            continue
        rows.append({"config": kind, "step_s": medians[kind], "memory_bytes": memory[kind], "peak_rss": rss[kind],
                     "vs_single": medians[kind] / medians["single"] if "single" in medians else None,
                     "vs_ddp": medians[kind] / medians["ddp"] if "ddp" in medians else None})
    shape = bench.source.shape()
    return {"model": bench.source.name, "params": shape.n_params, "world_size": bench.world_size,
            "global_batch": bench.global_batch, "seq_len": bench.source.seq_len, "rounds": bench.rounds,
            "steps": bench.steps, "machine": machine(), "rows": rows, "checks": checks(rows)}


def checks(rows: Sequence[dict]) -> list[dict]:
    """The issue's two claims, evaluated on this run's numbers."""
    ok = {r["config"]: r for r in rows if not r.get("error")}
    out = []
    z2 = ok.get("zeroshard_stage2")
    peers = [r for k, r in ok.items() if not k.startswith("zeroshard") and k != "single"]
    if z2:
        heavier = [r for r in peers if r["memory_bytes"] >= z2["memory_bytes"]]
        if heavier:
            best = min(heavier, key=lambda r: r["step_s"])
            ratio = z2["step_s"] / best["step_s"]
            out.append({"check": f"zeroshard_stage2 step time ÷ fastest peer holding as much memory or more "
                        f"({best['config']}) = {ratio:.3f} (limit {STAGE2_SLOWDOWN_LIMIT})",
                        "passed": ratio <= STAGE2_SLOWDOWN_LIMIT})
    zro = ok.get("ddp_zero1")
    for k in ("zeroshard_stage1", "zeroshard_stage2"):
        if zro and k in ok:
            out.append({"check": f"{k} memory {ok[k]['memory_bytes'] / 2**20:.1f} MiB ≤ ZeroRedundancyOptimizer "
                        f"{zro['memory_bytes'] / 2**20:.1f} MiB", "passed": ok[k]["memory_bytes"] <= zro["memory_bytes"]})
    return out


COLUMNS: list[tables.Column] = [
    ("configuration", "config", tables.text), ("step time (s)", "step_s", tables.ratio),
    ("÷ single AdamW(fused)", "vs_single", tables.ratio), ("÷ DDP", "vs_ddp", tables.ratio),
    ("model states MiB/rank", "memory_bytes", tables.mib), ("peak RSS MiB/rank", "peak_rss", tables.mib),
]


def report_markdown(result: dict) -> str:
    head = (f"model: {result['model']} ({result['params'] / 1e6:.1f}M params), global batch "
            f"{result['global_batch']}×{result['seq_len']} tokens, world size {result['world_size']} (gloo; "
            f"'single' is one process), medians of {result['rounds']} interleaved rounds × {result['steps']} steps; "
            f"machine: {result['machine']}")
    lines = [head, "", tables.markdown(result["rows"], COLUMNS, keys=1), ""]
    lines += [f"- {'PASS' if c['passed'] else 'FAIL'}: {c['check']}" for c in result["checks"]]
    return "\n".join(lines)

