"""Rank-side runs for the DCP tests: FSDP2 (``fully_shard``) + AdamW saving and loading with
``torch.distributed.checkpoint`` in torchtitan's layout, and zeroshard loading and saving the
same checkpoints. Each rank 0 writes its tensors with ``torch.save`` to ``{out}.pt``."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import zeroshard

VOCAB, SEQ, GLOBAL_BATCH = 32, 5, 12  # (12: every world size 1-4 takes an equal share)
LR, WD = 1e-2, 0.1
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL = StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True, cpu_offload=True)


class DcpNet(nn.Module):
    """Uneven shapes (a 33x7 head, a 1-element parameter) so flat partitions straddle tensors
    and FSDP2's row chunks are uneven."""

    def __init__(self, width: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 15)
        self.fc1 = nn.Linear(15, width)
        self.norm = nn.LayerNorm(width)
        self.gain = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(width, 33)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(self.emb(tokens)))) * self.gain
        return F.cross_entropy(self.head(h)[..., :VOCAB].reshape(-1, VOCAB), tokens.roll(1, -1).reshape(-1))


def local_batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    share = GLOBAL_BATCH // world
    return tokens[rank * share:(rank + 1) * share]


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _fsdp_model() -> DcpNet:
    model = DcpNet()
    for m in (model.fc1, model.head):
        fully_shard(m)
    fully_shard(model)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int,
           world: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``steps`` steps of this rank's share of the global batch; returns the scheduler."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(steps):
        model(local_batch(step, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return sched


def fsdp_run(rank: int, world: int, out: str, ckdir: str, steps: int) -> None:
    """FSDP2 trains ``steps`` steps and saves torchtitan's layout with ``dcp.save``; rank 0
    writes the full state saved and the full state after one more step (the continuation).
    Then an SGD run saves ``{ckdir}-sgd`` (another optimizer class)."""
    torch.manual_seed(0)
    other = _fsdp_model()
    sgd = torch.optim.SGD(other.parameters(), lr=LR, momentum=0.9)
    other(local_batch(0, rank, world)).backward()
    sgd.step()
    msd, osd = get_state_dict(other, sgd, options=FLAT)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=ckdir + "-sgd")
    torch.manual_seed(0)
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = _train(model, opt, steps, rank, world)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
              "train_state": {"step": steps}}, checkpoint_id=ckdir)
    saved = _cloned(get_state_dict(model, opt, options=FULL))  # (``step`` is the live tensor: the next step bumps it)
    model(local_batch(steps, rank, world)).backward()
    opt.step()
    after = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save({"saved": saved, "after": after, "lr": sched.get_last_lr()}, out + ".pt")
    json.dump({"ok": True}, open(f"{out}.rank{rank}", "w"))


def _cloned(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cloned(v) for v in tree)
    return {k: _cloned(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def zs_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """zeroshard's whole state under FSDP2's flattened full keys (a collective)."""
    weights = zeroshard.full_state_dict(model)
    osd = opt.consolidated_state_dict(to_rank=0)
    if weights is None or osd is None:
        return {}
    names = [n for n, _ in model.named_parameters()]
    out = dict(weights)
    for i, st in osd["state"].items():
        for k, v in st.items():
            out[f"state.{names[i]}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return out


def zs_resume(rank: int, world: int, out: str, ckdir: str, stage: int, steps: int) -> None:
    """zeroshard loads FSDP2's DCP checkpoint at this world size and stage, writes what it
    loaded, takes the next step and writes that."""
    torch.manual_seed(1)  # (other initial values: everything must come from the checkpoint)
    model = DcpNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    info = zeroshard.load_checkpoint(ckdir, model=model, optimizer=opt, scheduler=sched)
    loaded = zs_state(model, opt)
    steps_shapes = sorted({tuple(opt.state[p]["step"].shape) for p in model.parameters() if "step" in opt.state[p]})
    lr = sched.get_last_lr()
    model(local_batch(steps, rank, world)).backward()
    opt.step()
    after = zs_state(model, opt)
    if rank == 0:
        torch.save({"loaded": loaded, "after": after, "lr": lr}, out + ".pt")
    json.dump({"step": info["step"], "format": info.get("format"), "bytes_read": info["bytes_read"],
               "step_shapes": steps_shapes}, open(f"{out}.rank{rank}", "w"))


def zs_refused(rank: int, world: int, out: str, cases: list[tuple[str, int]]) -> None:
    """zeroshard loading checkpoints it must refuse ((directory, model width) each): the
    errors' types and texts."""
    got = []
    for ckdir, width in cases:
        model = DcpNet(width)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=1)
        try:
            zeroshard.load_checkpoint(ckdir, model=model, optimizer=opt)
            got.append({"error": None})
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the text
            got.append({"error": type(exc).__name__, "text": str(exc)})
    json.dump(got, open(f"{out}.rank{rank}", "w"))


def fsdp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt, options=FULL)
    return {**msd, **{k: v for k, v in osd.items() if isinstance(v, torch.Tensor)}}


def _hybrid_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))


def zs_save(rank: int, world: int, out: str, runs: list[tuple[str, int, Optional[str], bool]], steps: int) -> None:
    """For each (root, stage, NVMe directory or None, hybrid): zeroshard trains and saves
    ``format="dcp"`` (hybrid: on a (replicate 2 x shard 2) mesh, then a fresh optimizer on the
    mesh loads it back); rank 0 writes the whole state each saved (and loaded)."""
    saved, paths = [], []
    for root, stage, nvme, hybrid in runs:
        torch.manual_seed(0)
        model = DcpNet()
        offload = {"offload_optimizer": "nvme", "nvme_path": nvme} if nvme else {}
        mesh = {"mesh": _hybrid_mesh()} if hybrid else {}
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage, **offload,
                                      **mesh)
        sched = _train(model, opt, steps, rank, world)
        paths.append(zeroshard.save_checkpoint(root, steps, model=model, optimizer=opt, scheduler=sched,
                                               format="dcp").wait())
        saved.append({"saved": zs_state(model, opt), "lr": sched.get_last_lr()})
        if hybrid:
            torch.manual_seed(1)
            again = DcpNet()
            opt2 = zeroshard.ZeroOptimizer(again, torch.optim.AdamW, lr=LR, stage=stage, **mesh)
            zeroshard.load_checkpoint(root, model=again, optimizer=opt2)
            loaded = zs_state(again, opt2)
            saved[-1]["loaded"] = loaded
            if rank == 2:  # (the second replica's shard group loaded its own copy: its rank 0 reports it)
                torch.save(loaded, out + ".replica1.pt")
    if rank == 0:
        torch.save(saved, out + ".pt")
    json.dump({"paths": paths}, open(f"{out}.rank{rank}", "w"))


def fsdp_load(rank: int, world: int, out: str, ckdirs: list[str]) -> None:
    """FSDP2 loads each DCP checkpoint with ``dcp.load`` + ``set_state_dict`` (torchtitan's way)."""
    results = []
    for ckdir in ckdirs:
        torch.manual_seed(1)
        model = _fsdp_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        model(local_batch(0, rank, world)).backward()  # (the optimizer state must exist to be loaded into)
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt, options=FLAT)
        state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": -1}}
        dcp.load(state, checkpoint_id=ckdir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=FLAT)
        sched.load_state_dict(state["lr_scheduler"])
        results.append({"loaded": fsdp_state(model, opt), "lr": sched.get_last_lr(),
                        "step": state["train_state"]["step"]})
    if rank == 0:
        torch.save(results, out + ".pt")
    dist.barrier()
    json.dump({"ok": True}, open(f"{out}.rank{rank}", "w"))


def zs_torch_api(rank: int, world: int, out: str, fsdp_ck: str, root: str, runs: list[tuple[str, int]],
                 steps: int) -> None:
    """torchtitan-style code on a ZeroOptimizer, per (api, stage) of ``runs``: ``get_state_dict``
    + ``dcp.load`` of FSDP2's checkpoint + ``set_state_dict``, a step, then ``dcp.save`` and a
    fresh optimizer loading it. api "torch": torch's own functions (flattened optimizer keys,
    as torchtitan calls them); "zeroshard": ``zeroshard.checkpoint.dcp_state``'s drop-in."""
    from zeroshard.checkpoint.dcp_state import get_state_dict as zs_get, set_state_dict as zs_set

    def fresh(stage: int) -> tuple[nn.Module, Any, Any]:
        model = DcpNet()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)

    def get(api: str, model: nn.Module, opt: Any) -> tuple[dict, dict]:
        return get_state_dict(model, opt, options=FLAT) if api == "torch" else zs_get(model, opt)

    def load(api: str, model: nn.Module, opt: Any, ck: str) -> None:
        msd, osd = get(api, model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=ck)
        if api == "torch":
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=FLAT)
        else:
            zs_set(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    results = {}
    for api, stage in runs:
        torch.manual_seed(1)
        model, opt, sched = fresh(stage)
        load(api, model, opt, fsdp_ck)
        loaded, lr = zs_state(model, opt), [g["lr"] for g in opt.param_groups]
        model(local_batch(steps, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        after = zs_state(model, opt)
        msd, osd = get(api, model, opt)
        again = f"{root}-{api}-{stage}"
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=again)
        model2, opt2, sched2 = fresh(stage)
        load(api, model2, opt2, again)
        reloaded = zs_state(model2, opt2)
        model(local_batch(steps + 1, rank, world)).backward()
        model2(local_batch(steps + 1, rank, world)).backward()
        opt.step()
        opt2.step()
        results[f"{api}-{stage}"] = {"loaded": loaded, "lr": lr, "after": after, "reloaded": reloaded,
                                     "next": zs_state(model, opt), "next_reloaded": zs_state(model2, opt2),
                                     "keys": sorted(osd)}
    if rank == 0:
        torch.save(results, out + ".pt")
    json.dump({"ok": True}, open(f"{out}.rank{rank}", "w"))


def zs_crash(rank: int, world: int, out: str, root: str, point: str, occurrence: int) -> None:
    """Saves step 1 as DCP (its weights to ``{out}.expect``), then SIGKILLs itself at the
    ``occurrence``-th ``point`` of the save of step 2 (``commit.fault_hook``)."""
    import os
    import signal

    from zeroshard.checkpoint import commit
    torch.manual_seed(0)
    model = DcpNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=1)
    _train(model, opt, 1, rank, world)
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt, format="dcp")
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out + ".expect")
    _train(model, opt, 1, rank, world)
    seen = {"n": 0}

    def hook(name: str) -> None:
        if name == point:
            seen["n"] += 1
            if seen["n"] == occurrence:
                os.kill(os.getpid(), signal.SIGKILL)
    commit.fault_hook = hook if occurrence > 0 else None  # (0: step 2 is saved whole)
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt, format="dcp")
    json.dump({"killed": False}, open(f"{out}.rank{rank}", "w"))


def zs_load_roots(rank: int, world: int, out: str, roots: list[str]) -> None:
    """``load_checkpoint(root)`` of each root: the step it loaded and the weights (``{out}.pt``)."""
    got = []
    for root in roots:
        torch.manual_seed(5)
        model = DcpNet()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=1)
        info = zeroshard.load_checkpoint(root, model=model, optimizer=opt)
        got.append({"step": info["step"], "path": info["path"], "weights": model.state_dict()})
    torch.save(got, out + ".pt")
    json.dump({"ok": True}, open(f"{out}.rank{rank}", "w"))


def zs_convert(rank: int, world: int, out: str, fsdp_ck: str, native_root: str, dcp_root: str) -> None:
    """``zeroshard convert-dcp`` FSDP2's checkpoint to native and that back to DCP (the command
    line, in this process), then what a ZeroOptimizer loads from each (``{out}.pt``)."""
    from zeroshard.cli import main
    codes = [main(["convert-dcp", fsdp_ck, native_root]), main(["convert-dcp", native_root, dcp_root])]
    # (streamed; each equal, tensor for tensor, to the in-memory conversion of the same source)
    from tests.support import dcp_convert_in_memory
    from tests.support.dcp_convert_check import assert_same_checkpoint
    native_step = zeroshard.latest_checkpoint(native_root)
    assert_same_checkpoint(native_step, dcp_convert_in_memory.convert_dcp(fsdp_ck, native_root + "-ref"))
    assert_same_checkpoint(os.path.join(dcp_root, os.path.basename(native_step)),
                           dcp_convert_in_memory.convert_dcp(native_step, dcp_root + "-ref"))
    got = []
    for root in (native_root, dcp_root):
        model = DcpNet()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        info = zeroshard.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
        got.append({"state": zs_state(model, opt), "lr": sched.get_last_lr(), "step": info["step"]})
    torch.save(got, out + ".pt")
    json.dump({"codes": codes}, open(f"{out}.rank{rank}", "w"))


class DropNet(DcpNet):
    """DcpNet with dropout: a resume continues bitwise only if each rank's generator does."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.norm(self.fc1(self.emb(tokens)))), 0.3, self.training) * self.gain
        return F.cross_entropy(self.head(h)[..., :VOCAB].reshape(-1, VOCAB), tokens.roll(1, -1).reshape(-1))


class Position:
    """A per-rank data position (``state_dict``/``load_state_dict``)."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def zs_rng_resume(rank: int, world: int, out: str, root: str) -> None:
    """Trains DropNet 2 steps, saves DCP synchronously (``{root}/sync``), native converted to
    DCP by ``convert-dcp`` (``{root}/converted``) and DCP asynchronously (``{root}/async``, in
    flight while the next steps run), trains 2 more (the uninterrupted run); then, for each,
    fresh objects with other generator states load it and train the same 2 steps."""
    import random

    import numpy as np

    def fresh() -> tuple[nn.Module, Any]:
        model = DropNet()
        return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=2)

    def steps(model: nn.Module, opt: Any, pos: Position, a: int, b: int) -> list[float]:
        draws = []
        for step in range(a, b):
            model(local_batch(step, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            pos.pos += 1
            draws.append(random.random() + float(np.random.rand()))
        return draws

    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    model, opt = fresh()
    pos = Position(10 * rank)
    steps(model, opt, pos, 0, 2)
    zeroshard.save_checkpoint(root + "/sync", 2, model=model, optimizer=opt, dataloader=pos, format="dcp")
    zeroshard.save_checkpoint(root + "/native", 2, model=model, optimizer=opt, dataloader=pos)
    if rank == 0:  # (`zeroshard convert-dcp`, offline: a process of its own, as a user runs it)
        import subprocess
        import sys
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, "-m", "zeroshard.cli", "convert-dcp", root + "/native", root + "/converted"],
                       check=True, cwd=repo, capture_output=True,
                       env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                              "MASTER_ADDR", "MASTER_PORT")},
                            "PYTHONPATH": repo})
    dist.barrier()
    handle = zeroshard.save_checkpoint(root + "/async", 2, model=model, optimizer=opt, dataloader=pos, format="dcp",
                                       async_save=True)
    draws = steps(model, opt, pos, 2, 4)
    handle.wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    got = {}
    for kind in ("sync", "async", "converted"):
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        model, opt = fresh()
        pos2 = Position()
        info = zeroshard.load_checkpoint(root + "/" + kind, model=model, optimizer=opt, dataloader=pos2)
        loaded_pos = pos2.pos
        draws2 = steps(model, opt, pos2, 2, 4)
        same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
        got[kind] = {"rng_restored": info["rng_restored"], "same": same, "draws": draws == draws2,
                     "pos": loaded_pos, "resharded": info["resharded"]}
    json.dump(got, open(f"{out}.rank{rank}", "w"))


def zs_crash_many(rank: int, world: int, out: str, base: str, points: list[tuple[str, int]]) -> None:
    """One process, many kills: saves step 1 as DCP into ``{base}/template`` (its weights:
    the expectation), trains a step, then per kill point forks a child that saves step 2 into
    a copy of the template and SIGKILLs itself at the ``n``-th ``point``
    (``commit.fault_hook``); the parent then loads each root. Runs without a process group
    (a forked child has no gloo threads), at world size 1."""
    import os
    import shutil
    import signal

    from zeroshard.checkpoint import commit
    dist.destroy_process_group()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DcpNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=1)
    _train(model, opt, 1, 0, 1)
    template = os.path.join(base, "template")
    zeroshard.save_checkpoint(template, 1, model=model, optimizer=opt, format="dcp")
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1, 0, 1)
    report = []
    for i, (point, n) in enumerate(points):
        root = os.path.join(base, f"run{i}")
        shutil.copytree(template, root)
        pid = os.fork()
        if pid == 0:  # the child: save step 2, die at the point
            seen = {"n": 0}

            def hook(name: str) -> None:
                if name == point:
                    seen["n"] += 1
                    if seen["n"] == n:
                        os.kill(os.getpid(), signal.SIGKILL)
            commit.fault_hook = hook
            try:
                zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt, format="dcp")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        torn = any(".tmp-" in name for name in os.listdir(root))
        torch.manual_seed(5)
        fresh = DcpNet()
        fopt = zeroshard.ZeroOptimizer(fresh, torch.optim.AdamW, lr=LR, stage=1)
        info = zeroshard.load_checkpoint(root, model=fresh, optimizer=fopt)
        same = all(torch.equal(v, expect[k]) for k, v in fresh.state_dict().items())
        report.append({"point": point, "n": n, "killed": killed, "torn": torn, "step": info["step"],
                       "path": os.path.basename(info["path"]), "same": same})
    json.dump({"report": report}, open(f"{out}.rank{rank}", "w"))
