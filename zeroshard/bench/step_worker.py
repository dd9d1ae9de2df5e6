"""One rank of ``bench step``: a few timed training steps of one trainer (``peers.py``)."""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from zeroshard.bench import peers
from zeroshard.bench.models import ModelSource
from zeroshard.offload.process_rss import peak_rss


def worker(rank: int, world: int, source: ModelSource, kind: str, steps: int, global_batch: int, out: str) -> None:
    torch.manual_seed(0)
    model = source.build()
    trainer = peers.build(kind, model, source.loss, global_batch // world)
    times, mem = [], 0
    for step in range(steps + 1):  # step 0 warms up (lazy state, first-call allocations)
        x, y = source.batch(step, global_batch, rank, world, torch.device("cpu"))
        if world > 1:
            dist.barrier()  # every rank starts together: the time is the slowest rank's
        t0 = time.perf_counter()
        trainer.step(x, y)
        if step == steps:  # gradients and optimizer state alive at once: the rank's peak
            mem = trainer.model_state_bytes()
        trainer.zero_grad()
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    result = {"times": times[1:], "memory": mem, "peak_rss": peak_rss()}
    gathered: list[dict] = [result]
    if world > 1:
        gathered = [{} for _ in range(world)]  # (places all_gather_object fills, one per rank)
        dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": result["times"], "memory": max(g["memory"] for g in gathered),
                       "peak_rss": max(g["peak_rss"] for g in gathered)}, f)
