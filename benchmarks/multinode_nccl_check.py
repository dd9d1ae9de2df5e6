"""Hybrid sharding and ZeRO++ hpZ on NCCL, for a lent GPU machine (a few minutes; <= 10):

    python benchmarks/multinode_nccl_check.py [--out DIR] [--backend auto|nccl|gloo]

4 local ranks act as 2 nodes x 2 (a (node, local) DeviceMesh), as tests/dist/test_hpz.py and the
hybrid case of tests/dist/test_dropin.py do on gloo:

- parity: hpZ at stage 3 and hybrid at stages 1-3, 8 steps of a tiny GPT-2 with clipping,
  against single-process torch.optim.AdamW on the same global batch (fp32, max weight
  difference < 1e-5), and an hpZ resume that continues bit for bit;
- accounting: one steady-state step of flat stage 3, hybrid 2x2 and hpZ 2x2, every collective
  from ``comm_report`` against the formulas of zeroshard/planner/traffic.py, and the
  intra-/inter-node bytes table.

Backends: "nccl" needs a GPU per rank (NCCL refuses two ranks on one GPU) and runs with
``cuda:nccl,cpu:gloo`` so zeroshard's small CPU flags still have a backend; "gloo" runs on
CUDA tensors when a GPU is visible (ranks share GPUs round-robin) and on the CPU otherwise
(the fallback this repository's CI runs). "auto" picks nccl when there are 4 GPUs. Writes
``nccl_check.json`` and ``nccl_check.md`` to --out (default $OUT, else /tmp/zeroshard-nccl);
exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zeroshard  # noqa: E402
from tests.support.dropin_worker import GLOBAL_BATCH, MAX_NORM, STEPS, gpt2, tokens  # noqa: E402
from zeroshard.testing.launch import free_port  # noqa: E402
from zeroshard.planner.traffic import Topology, measured_links, step_traffic  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
PARITY = [("hpz", 3), ("hybrid", 1), ("hybrid", 2), ("hybrid", 3)]
ACCOUNTING = [("flat", 3), ("hybrid", 3), ("hpz", 3)]


def _kwargs(scope: str, stage: int, device: torch.device) -> dict:
    if scope == "flat":
        return {"stage": stage}
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (NODES, PER_NODE), mesh_dim_names=("node", "local"))
    return {"stage": stage, "mesh": mesh, **({"hpz": True} if scope == "hpz" else {})}


def _train(model, opt, device, rank: int, world: int, start: int, stop: int, clip: bool = True) -> None:
    per = GLOBAL_BATCH // world
    for step in range(start, stop):
        batch = tokens(step)[rank * per:(rank + 1) * per].to(device)
        model(input_ids=batch, labels=batch).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        model.zero_grad()


def _full(model) -> dict:
    return {n: t.float().cpu() for n, t in zeroshard.full_state_dict(model, rank0_only=False).items()}


def _zero(scope: str, stage: int, device: torch.device):
    model = gpt2().to(device)
    return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                          **_kwargs(scope, stage, device))


def _rank(rank: int, port: int, backend: str, out: str, ckpt: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo" if backend == "nccl" else "gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    result: dict = {"device": str(device), "backend": backend, "parity": {}, "accounting": {}}
    try:
        ref = gpt2().to(device)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        _train(ref, ref_opt, device, 0, 1, 0, STEPS)
        ref_w = {n: p.detach().float().cpu() for n, p in ref.named_parameters()}
        for scope, stage in PARITY:
            model, opt = _zero(scope, stage, device)
            _train(model, opt, device, rank, WORLD, 0, STEPS)
            got = _full(model)
            result["parity"][f"{scope}-{stage}"] = max(float((got[n] - ref_w[n]).abs().max()) for n in ref_w)
            opt.close()
        m1, o1 = _zero("hpz", 3, device)
        _train(m1, o1, device, rank, WORLD, 0, 4)
        zeroshard.save_checkpoint(ckpt, 4, model=m1, optimizer=o1)
        _train(m1, o1, device, rank, WORLD, 4, 8)
        m2, o2 = _zero("hpz", 3, device)
        zeroshard.load_checkpoint(ckpt, model=m2, optimizer=o2)
        _train(m2, o2, device, rank, WORLD, 4, 8)
        a, b = _full(m1), _full(m2)
        result["hpz_resume_bitwise"] = all(torch.equal(a[n], b[n]) for n in a)
        for scope, stage in ACCOUNTING:
            model, opt = _zero(scope, stage, device)
            _train(model, opt, device, rank, WORLD, 0, 1, clip=False)  # (steady state from here)
            opt.comm_report(reset=True)
            _train(model, opt, device, rank, WORLD, 1, 2, clip=False)
            report = opt.comm_report(reset=True)
            root = opt.engine.gatherer.root
            units = [(u.layout.numel, i == root) for i, u in enumerate(opt.units)]
            want = step_traffic(stage, Topology(NODES, PER_NODE, scope=scope), units, opt.units[0].flat.element_size(),
                                n_tensors=sum(len(u.layout.segments) for u in opt.units))
            got_kinds: Counter = Counter()
            for key, entry in report.items():
                link = "intra" if measured_links({key: entry}, NODES)["intra_node"] else "inter"
                got_kinds[f"{key.split('@')[0]}/{link}"] += entry["bytes"]
            want_kinds: Counter = Counter()
            for kind, link, nbytes in want.kinds:
                want_kinds[f"{kind}/{link}"] += nbytes
            result["accounting"][scope] = {"measured": measured_links(report, NODES), "formula": want.as_dict(),
                                           "equal": got_kinds == want_kinds, "kinds": dict(got_kinds)}
            opt.close()
    except Exception:
        result["error"] = traceback.format_exc()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _table(r: dict) -> str:
    lines = ["| scope (stage 3, 2 nodes x 2) | intra-node bytes/step | inter-node bytes/step | = formula |",
             "|---|---|---|---|"]
    for scope, a in r["accounting"].items():
        lines.append(f"| {scope} | {a['measured']['intra_node']} | {a['measured']['inter_node']} | {a['equal']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/zeroshard-nccl")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    a = ap.parse_args()
    backend = a.backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= WORLD else "gloo"
    if backend == "nccl" and gpus < WORLD:
        print(f"multinode_nccl_check: nccl needs {WORLD} GPUs (one per rank), {gpus} visible; use --backend gloo",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "res")
        mp.start_processes(_rank, args=(free_port(), backend, res, os.path.join(tmp, "ckpt")), nprocs=WORLD,
                           start_method="spawn")
        ranks = [json.load(open(f"{res}.rank{r}")) for r in range(WORLD)]
    ok = True
    for r in ranks:
        if "error" in r:
            print(r["error"], file=sys.stderr)
            ok = False
            continue
        ok &= all(d < 1e-5 for d in r["parity"].values()) and r["hpz_resume_bitwise"]
        ok &= all(x["equal"] for x in r["accounting"].values())
        hpz = r["accounting"]["hpz"]
        ok &= hpz["kinds"].get("all_gather/inter", 0) == next(
            n for k, link, n in hpz["formula"]["kinds"] if k == "all_gather" and link == "inter")  # (the rebuild only)
    r0 = ranks[0]
    summary = {"backend": backend, "gpus": gpus, "torch": torch.__version__, "ranks": ranks, "ok": bool(ok)}
    with open(os.path.join(a.out, "nccl_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = (f"backend {backend} on {r0.get('device')} ({gpus} GPUs), torch {torch.__version__}\n\n"
            f"parity (max |w - torch.optim.AdamW|): {r0.get('parity')}; hpZ resume bitwise: "
            f"{r0.get('hpz_resume_bitwise')}\n\n" + (_table(r0) if "accounting" in r0 else "") + "\n")
    with open(os.path.join(a.out, "nccl_check.md"), "w") as f:
        f.write(text)
    print(text + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
