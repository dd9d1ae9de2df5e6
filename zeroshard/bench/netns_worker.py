"""One rank of ``zeroshard bench link`` (started by torchrun inside a namespace, netns_launch.py):
a TinyGPT trained at stage 3 under each configuration of the job file, steps interleaved by
round so that machine noise hits every configuration alike, timed between barriers, with the
bytes ``comm_report`` counted per link for one step. Writes ``<out>/rank<R>.json``.

``python -m zeroshard.bench.netns_worker JOB.json`` where the job file holds ``model``
(``ModelSource.parse`` arguments), ``global_batch``, ``steps`` (timed, per round), ``rounds``,
``nodes``, ``per_node`` and ``configs``: ``[{"label", "scope": flat|hybrid|hpz, "kwargs"}]``,
the kwargs passed to ``ZeroOptimizer`` as they are (a codec's options, for one)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

SCOPES = ("flat", "hybrid", "hpz")


def scope_kwargs(scope: str, stage: int, nodes: int, per_node: int) -> dict:
    """ZeroOptimizer's arguments for a sharding scope over ``nodes x per_node`` ranks."""
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r}: use one of {', '.join(SCOPES)}")
    if scope == "flat":
        return {"stage": stage}
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("node", "local"))
    return {"stage": stage, "mesh": mesh, **({"hpz": True} if scope == "hpz" else {})}


def main(job_path: str) -> None:
    import zeroshard
    from zeroshard.bench.models import ModelSource
    from zeroshard.planner.traffic import measured_links

    with open(job_path) as f:
        job = json.load(f)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job["nodes"] * job["per_node"]:
        raise RuntimeError(f"world size {world} is not nodes x per_node = {job['nodes']} x {job['per_node']}")
    m = job["model"]
    source = ModelSource.parse(m["name"], d_model=m.get("d_model", 0), n_layers=m.get("layers", 0),
                               seq_len=m.get("seq_len", 0))
    runs = []
    for c in job["configs"]:
        torch.manual_seed(0)
        model = source.build()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3,
                                      **scope_kwargs(c["scope"], 3, job["nodes"], job["per_node"]), **c["kwargs"])
        runs.append((c["label"], model, opt))
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    losses: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    links: dict[str, dict[str, int]] = {}
    step = 0

    def one(label: str, model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, timed: bool) -> None:
        x, y = source.batch(step, job["global_batch"], rank, world, torch.device("cpu"))
        opt.comm_report(reset=True)
        dist.barrier()  # every rank starts together: the time is the slowest rank's
        t0 = time.perf_counter()
        loss = source.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        dt = time.perf_counter() - t0
        losses[label].append(float(loss))
        if timed:
            times[label].append(dt)
            links[label] = measured_links(opt.comm_report(), job["nodes"])

    for label, model, opt in runs:  # warm-up: lazy state, first-call allocations, pair connections
        one(label, model, opt, timed=False)
    for _ in range(job["rounds"]):
        step += 1
        for label, model, opt in runs:
            for _ in range(job["steps"]):
                one(label, model, opt, timed=True)
    for _, _, opt in runs:
        opt.close()
    out = {"rank": rank, "world": world, "node": int(os.environ.get("ZS_NETNS_NODE", "-1")),
           "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
           "configs": {label: {"times": times[label], "losses": losses[label], **links[label]} for label in times}}
    with open(os.path.join(job["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
