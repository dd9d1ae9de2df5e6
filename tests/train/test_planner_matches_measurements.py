"""The planner's model-state predictions against ``bench memory`` measurements (tensor
accounting on real gloo ranks) for three model sizes: within 10%."""
from __future__ import annotations

import json
import os

import pytest

from zeroshard.bench.configs import MemConfig
from zeroshard.bench.memory_worker import measure
from zeroshard.bench.models import ModelSource
from zeroshard.testing.launch import spawn
from zeroshard.planner import Hardware, Workload, estimate

SOURCES = [ModelSource.parse("tiny"), ModelSource.parse("small"), ModelSource.parse("tiny", d_model=192, n_layers=3)]
WORLD = 2


def _measure_all(rank: int, world: int, out: str) -> None:
    res = {f"{i}/{s}": measure(src, MemConfig(s), 1, 2, None, rank, world, out)
           for i, src in enumerate(SOURCES) for s in (0, 1, 2, 3)}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)


def test_estimate_matches_measured_model_states(tmp_path) -> None:
    spawn(_measure_all, WORLD, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(WORLD)]
    sizes = set()
    for i, src in enumerate(SOURCES):
        shape = src.shape()
        sizes.add(shape.n_params)
        for stage in (0, 1, 2, 3):
            measured = max(r[f"{i}/{stage}"]["report"]["model_states"] for r in ranks)
            e = estimate(MemConfig(stage).choice, shape, Hardware(gpu_memory=1 << 50, n_gpus=WORLD), Workload(
                micro_batch=1, seq_len=src.seq_len, mixed_precision=None))
            assert e.gpu_states.model_states == pytest.approx(measured, rel=0.10), (shape.n_params, stage)
    assert len(sizes) == 3
