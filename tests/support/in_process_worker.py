"""A worker of tests/dist/test_in_process_recovery.py, started by the test (which hosts the
store): trains with ``InProcessRecovery`` (Note [in-process recovery] in
zeroshard/train/in_process.py); one member SIGKILLs itself mid-step, the others recover in
their processes; then, in the same processes, the reference: the disk save of the recovered
step resumed at the new world with a fresh tier and trained as far."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard import InProcessOptions, InProcessRecovery, Trainee
from zeroshard.train.in_process import RecoveryFailed
from zeroshard.testing import kill_points
from tests.support.peer_worker import save_owned


def host_store(port_file: str) -> None:
    """The job's store in a process of its own (torchrun's agent's role), so that a test can
    SIGKILL it: writes its port to ``port_file`` and serves until killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.replace(port_file + ".tmp", port_file)
    while True:
        time.sleep(3600)


def _build(tier: str, stage: int):
    def build(rank: int, world: int) -> Trainee:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, bucket_size_mb=0.001,
                                      redundancy=zeroshard.PeerRedundancy(path=tier, run_id="in-process", every=1))
        torch.manual_seed(100 + rank)  # (as a fresh process would)
        return Trainee(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    return build


def _train_step(t: Trainee, step: int, xs: torch.Tensor, ys: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    i = (step * world + rank) * 4 % 512
    loss = ((t.model(xs[i:i + 4]) - ys[i:i + 4]) ** 2).mean()
    t.optimizer.backward(loss)
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad()


def worker(member: int, world: int, port: int, out: str, tier: str, stage: int, kill_member: int, kill_step: int,
           steps: int, stop: bool = False, second: int = -1, store_pid: int = 0, timeout_s: float = 0.0) -> None:
    """``stop``: the member is SIGSTOPped at the boundary before ``kill_step`` (its last commit
    finished everywhere: a hang detected by the collectives' timeout), not SIGKILLed mid-step.
    ``second``: that member SIGKILLs itself inside the first recovery, after its piece exchange
    is posted (the ``recovery`` kill point, armed in this process only: it does not restart).
    ``store_pid``: the killed member SIGKILLs the store's host just before itself; the others
    must end with ``RecoveryFailed`` (written to ``failed-<member>.json``) and exit 3."""
    root, ref = os.path.join(out, "ckpt"), os.path.join(out, "ref")
    reads: list[str] = []  # files opened for reading under the checkpoint root (Python's audit events)
    watch = os.path.realpath(root) + os.sep

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes)) and (
                args[2] if len(args) > 2 and isinstance(args[2], int) else 0) & os.O_ACCMODE == os.O_RDONLY:
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(watch) and os.path.isfile(path):
                reads.append(path)
    sys.addaudithook(audit)
    gen = torch.Generator().manual_seed(123)
    xs, ys = torch.randn(512, 16, generator=gen), torch.randn(512, 8, generator=gen)
    # (a stopped member: its heartbeat goes stale after 1 s; a killed one is seen gone from the
    # process table at once, well before 5 s)
    options = InProcessOptions("127.0.0.1", port, timeout_s=timeout_s or (4.0 if stop else 30.0),
                               dead_after_s=1.0 if stop else 5.0)
    rec = InProcessRecovery(options,
                            rank=member, world_size=world, build=_build(tier, stage), root=root)
    rec.start()
    if member == second:  # its rank in generation 1 (the members but the first lost), either recovered step
        rank1 = [m for m in range(world) if m != kill_member].index(member)
        kill_points.ARMED = tuple(kill_points.KillAt("recovery", k, rank1) for k in (kill_step - 2, kill_step - 1))

    def step_fn(t: Trainee, step: int) -> None:
        first = rec.generation == 0
        if first and step + 1 == kill_step:
            if stop:
                t.optimizer.engine.memory_tier.wait()
            dist.barrier()  # (every rank saved the steps before: the reference has them)
            if stop and member == kill_member:
                os.kill(os.getpid(), signal.SIGSTOP)
        _train_step(t, step, xs, ys)
        if first and step + 1 == kill_step and member == kill_member:
            if store_pid:
                with open(os.path.join(out, "killed-at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(store_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after the optimizer step, before its commit
        if first:  # the reference's disk saves, and one regular save (older than the tiers' steps)
            zeroshard.save_checkpoint(os.path.join(ref, f"step-{step + 1}"), step + 1, model=t.model,
                                      optimizer=t.optimizer, scheduler=t.scheduler)
            if step + 1 == 2:
                zeroshard.save_checkpoint(root, step + 1, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
                reads.clear()
    try:
        while rec.step < steps:
            rec.run(step_fn)
    except RecoveryFailed as exc:
        with open(os.path.join(out, f"failed-{member}.json"), "w") as f:
            json.dump({"at": time.time(), "error": str(exc), "recoveries": rec.recoveries}, f)
        sys.exit(3)
    t = rec.objects
    t.optimizer.engine.memory_tier.wait()
    rank = rec.rank
    save_owned(t.model, t.optimizer, os.path.join(out, f"final-{rank}.safetensors"))
    result = {"pid": os.getpid(), "member": member, "rank": rank, "world": rec.world_size,
              "recoveries": rec.recoveries, "disk_bytes_read": sum(os.path.getsize(p) for p in set(reads))}
    # a disk save after the recovery: on the new world's side group, not the destroyed one's
    saved = zeroshard.save_checkpoint(os.path.join(out, "after"), rec.step, model=t.model, optimizer=t.optimizer,
                                      scheduler=t.scheduler).wait()
    result["saved_after"] = os.path.isdir(saved)
    # The reference: the disk save of the recovered step, resumed at this world with a fresh tier.
    if rec.recoveries:
        t = _build(tier + "-ref", stage)(rank, rec.world_size)
        k = rec.recoveries[-1]["step"]
        info = zeroshard.load_checkpoint(os.path.join(ref, f"step-{k}"), model=t.model, optimizer=t.optimizer,
                                         scheduler=t.scheduler)
        result["ref_source"], result["ref_step"] = info.get("source"), info["step"]
        for step in range(k, steps):
            _train_step(t, step, xs, ys)
        save_owned(t.model, t.optimizer, os.path.join(out, f"ref-final-{rank}.safetensors"))
    with open(os.path.join(out, f"result-{member}.json"), "w") as f:
        json.dump(result, f)
    rec.close()
