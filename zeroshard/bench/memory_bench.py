"""``zeroshard bench memory``: per-rank bytes by category for stages × offload × world sizes,
measured on real gloo ranks, next to the ZeRO formulas and the planner's estimate.

One set of processes per world size measures every configuration in turn (memory_worker).
Per-rank figures are the maximum over ranks (ranks differ only by padding).
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from zeroshard.bench import tables
from zeroshard.bench.configs import MemConfig
from zeroshard.bench.memory_worker import worker
from zeroshard.bench.models import ModelSource
from zeroshard.testing.launch import spawn
from zeroshard.memory import zero_formula
from zeroshard.planner.estimate import Hardware, Workload, estimate
from zeroshard.planner.model_shape import ModelShape

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers", "offloaded")
THEORY_TOLERANCE = 0.05
ESTIMATE_TOLERANCE = 0.10


@dataclass(frozen=True)
class MemoryBench:
    source: ModelSource
    configs: tuple[MemConfig, ...]
    world_sizes: tuple[int, ...] = (1, 2, 4)
    steps: int = 2
    global_batch: int = 4
    mixed_precision: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.configs or not self.world_sizes:
            raise ValueError("bench memory needs at least one configuration and one world size")
        if any(w < 1 for w in self.world_sizes):
            raise ValueError(f"world sizes {self.world_sizes} must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1 (optimizer state appears at the first step)")
        bad = [w for w in self.world_sizes if self.global_batch % w]
        if bad:
            raise ValueError(f"global batch {self.global_batch} does not split over world sizes {bad}; "
                             "use a multiple of each, e.g. --global-batch 4")


def _rank_results(bench: MemoryBench, world: int) -> list[dict]:
    # glibc raises its mmap threshold after large frees, after which freed tensors stay in the
    # heap and later configurations' RSS looks smaller than it is; a fixed threshold (read at
    # process start, so set for the children) keeps every large tensor in its own mapping.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, world, bench.source, list(bench.configs), bench.steps, bench.global_batch,
              bench.mixed_precision, tmp)
        return [json.load(open(os.path.join(tmp, f"rank-{r}.json"))) for r in range(world)]


def _row(bench: MemoryBench, shape: ModelShape, world: int, cfg: MemConfig, per_rank: list[dict]) -> dict:
    row: dict = {"world_size": world, "config": cfg.label, "stage": cfg.stage, "offload": "+".join(o for o in (cfg.offload_optimizer, cfg.offload_params) if o)}
    errors = [r[cfg.label].get("error") for r in per_rank if r[cfg.label].get("error")]
    if errors:
        return {**row, "error": errors[0]}
    mixed = bench.mixed_precision is not None
    theory = zero_formula(cfg.stage, shape.n_params, world, param_bytes=2 if mixed else 4, mixed_precision=mixed)
    for k in CATEGORIES + ("model_states",):
        row[k] = max(r[cfg.label]["report"].get(k, 0) for r in per_rank)
    extra = sorted({k for r in per_rank for k in r[cfg.label]["report"]} - set(CATEGORIES) - {"model_states"})
    for k in extra:  # categories the optimizer reports that this table does not know yet (offload staging)
        row[k] = max(r[cfg.label]["report"].get(k, 0) for r in per_rank)
    row["theory_model_states"] = theory.model_states
    row["measured_over_theory"] = row["model_states"] / theory.model_states
    est = estimate(cfg.choice, shape, Hardware(gpu_memory=1 << 60, n_gpus=world, accelerator=torch.cuda.is_available()),
                   Workload(micro_batch=bench.global_batch // world, seq_len=bench.source.seq_len,
                            mixed_precision=bench.mixed_precision))
    row["estimate_model_states"] = est.gpu_states.model_states + est.cpu_per_rank + est.nvme_per_rank
    # NVMe-resident state (``offloaded``) is outside model_states but inside the estimate's sum
    row["estimate_over_measured"] = row["estimate_model_states"] / (row["model_states"] + row.get("offloaded", 0))
    row["estimate_peak"] = est.gpu_total  # device memory: model states on it + buffers + activations
    row["peak_rss"] = max(r[cfg.label]["peak_rss"] for r in per_rank)
    row["rss_growth"] = max(r[cfg.label]["rss_growth"] for r in per_rank)
    cuda = [r[cfg.label].get("cuda_max_allocated") for r in per_rank]
    row["cuda_max_allocated"] = max(cuda) if all(c is not None for c in cuda) else None
    return row


def _add_fractions(rows: list[dict]) -> None:
    """Model states as a fraction of stage 0 at the same world size, measured and in theory."""
    base = {r["world_size"]: r for r in rows if r.get("stage") == 0 and not r.get("offload") and not r.get("error")}
    for r in rows:
        b = base.get(r["world_size"])
        if b is None or r.get("error"):
            continue
        r["fraction_of_stage0"] = r["model_states"] / b["model_states"]
        r["theory_fraction_of_stage0"] = r["theory_model_states"] / b["theory_model_states"]


def run(bench: MemoryBench, log=print) -> dict:
    shape = bench.source.shape()
    rows: list[dict] = []
    for world in bench.world_sizes:
        log(f"world size {world}: {', '.join(c.label for c in bench.configs)} ...")
        per_rank = _rank_results(bench, world)
        rows += [_row(bench, shape, world, cfg, per_rank) for cfg in bench.configs]
    _add_fractions(rows)
    return {"model": bench.source.name, "params": shape.n_params, "steps": bench.steps,
            "global_batch": bench.global_batch, "seq_len": bench.source.seq_len,
            "mixed_precision": bench.mixed_precision or "fp32", "machine": machine(), "rows": rows,
            "checks": checks(rows)}


def checks(rows: Sequence[dict]) -> list[dict]:
    """At the largest world size: stage k's fraction of stage 0, measured vs theory (5%), and
    the planner's model states vs measured (10%) for every row that ran."""
    ok = [r for r in rows if not r.get("error")]
    out = []
    if ok:
        top = max(r["world_size"] for r in ok)
        for r in ok:
            if r["world_size"] == top and r["stage"] > 0 and not r["offload"] and "fraction_of_stage0" in r:
                dev = abs(r["fraction_of_stage0"] / r["theory_fraction_of_stage0"] - 1)
                out.append({"check": f"{r['config']} / stage 0 at world size {top}: measured "
                            f"{r['fraction_of_stage0']:.3f} vs theory {r['theory_fraction_of_stage0']:.3f}",
                            "deviation": dev, "passed": dev <= THEORY_TOLERANCE})
    worst = max(ok, key=lambda r: abs(r["estimate_over_measured"] - 1), default=None)
    if worst is not None:
        dev = abs(worst["estimate_over_measured"] - 1)
        out.append({"check": f"estimate vs measured model states, worst of {len(ok)} rows "
                    f"({worst['config']}, world size {worst['world_size']})",
                    "deviation": dev, "passed": dev <= ESTIMATE_TOLERANCE})
    return out


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{_total_ram() / 2**30:.0f} GiB RAM, {gpu}, torch {torch.__version__}, gloo")


def _total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


COLUMNS: list[tables.Column] = [
    ("world", "world_size", tables.text), ("configuration", "config", tables.text),
    ("params MiB", "parameters", tables.mib), ("grads MiB", "gradients", tables.mib),
    ("master MiB", "master_weights", tables.mib), ("optim MiB", "optimizer_states", tables.mib),
    ("buffers MiB", "buffers", tables.mib), ("NVMe MiB", "offloaded", tables.mib),
    ("model states MiB", "model_states", tables.mib),
    ("theory MiB", "theory_model_states", tables.mib), ("measured ÷ theory", "measured_over_theory", tables.ratio),
    ("÷ stage 0 (measured)", "fraction_of_stage0", tables.ratio),
    ("÷ stage 0 (theory)", "theory_fraction_of_stage0", tables.ratio),
    ("estimate MiB", "estimate_model_states", tables.mib), ("estimate ÷ measured", "estimate_over_measured", tables.ratio),
    ("peak RSS growth MiB", "rss_growth", tables.mib), ("cuda max allocated MiB", "cuda_max_allocated", tables.mib),
    ("estimate peak MiB", "estimate_peak", tables.mib),
]


def report_markdown(result: dict) -> str:
    rows = result["rows"]
    columns = list(COLUMNS)
    known = {k for _, k, _ in columns}
    extra = sorted({k for r in rows for k in r if k.endswith(("staging", "_cpu", "_nvme")) and k not in known})
    columns[8:8] = [(f"{k} MiB", k, tables.mib) for k in extra]  # e.g. pinned staging, once offload reports it
    if all(r.get("cuda_max_allocated") is None for r in rows):
        columns = [c for c in columns if c[1] != "cuda_max_allocated"]
    head = (f"model: {result['model']} ({result['params'] / 1e6:.2f}M params), {result['mixed_precision']}, "
            f"global batch {result['global_batch']}×{result['seq_len']}, {result['steps']} AdamW steps; "
            f"machine: {result['machine']}")
    lines = [head, "", tables.markdown(rows, columns), ""]
    lines += [f"- {'PASS' if c['passed'] else 'FAIL'}: {c['check']} (off by {c['deviation']:.1%})" for c in result["checks"]]
    lines.append("\nModel states and buffers are tensor accounting (ZeroOptimizer.memory_report, peak over "
                 "the steps); NVMe is the rank's swap file (not in model states; the optimizer column then "
                 "holds the swap buffers); peak RSS growth is the process's high-water mark minus its RSS "
                 "before the model was built (activations, allocator and communication overheads "
                 "included); estimate peak is the planner's device total (model states, buffers, "
                 "activations) for the same micro-batch.")
    return "\n".join(lines)
