"""A torchrun worker for the memory-tier tests (tests/dist/test_peer_recovery.py): trains a small
model with ``redundancy="peer"``, optionally saves to disk at one step, SIGKILLs one rank after
another step's commit, or SIGTERMs some ranks mid-step (a preemption: the ranks agree, hand the
step to the peers' tiers and exit 0) (first attempt only), resumes through ``load_checkpoint``
(memory tiers first) and dumps its final owned pieces for a bitwise comparison."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zeroshard
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.pieces import owned_pieces
from zeroshard.train.faults import Fault
from zeroshard.train.finetune import setup_distributed
from zeroshard.train.preemption import PreemptionHandler


def build(tier: str, stage: int, every: int = 1, parity: int = 0) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, bucket_size_mb=0.001,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="peer-test", every=every,
                                                                                      parity=parity or None))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def resume(root: str, model, opt, sched, opened: list[str], out: str) -> int:
    """``load_checkpoint`` (memory tiers first); what it found goes to ``out``; the step resumed."""
    opened.clear()
    try:
        info = zeroshard.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    except CheckpointError:
        return 0
    with open(out, "w") as f:
        json.dump({**{k: info.get(k) for k in ("step", "source", "world_size", "resharded")},
                   "disk_bytes_read": sum(os.path.getsize(p) for p in set(opened) if os.path.isfile(p))}, f)
    return info["step"]


def owned_state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's owned pieces (tensors and scalars), cloned, by ``name|start|stop|kind``."""
    final = {}
    for rec in owned_pieces(model, opt):
        for kind, t in rec.tensors.items():
            final[f"{rec.name}|{rec.start}|{rec.stop}|{kind}"] = t.detach().clone()
        for k, v in rec.scalars.items():
            final[f"{rec.name}|{rec.start}|{rec.stop}|scalar.{k}"] = torch.as_tensor(v).clone()
    return final


def save_owned(model, opt, out: str) -> None:
    """This rank's owned pieces (tensors and scalars), for a bitwise comparison (safetensors: nothing
    here is ever unpickled)."""
    save_file(owned_state(model, opt), out)


def merged(out: str, world: int, prefix: str = "final") -> dict[str, torch.Tensor]:
    """Every (parameter, kind) as one tensor over all ranks' pieces saved by ``save_owned`` as
    ``{prefix}-{rank}.safetensors`` (scalars: rank 0's first piece)."""
    parts: dict[str, list] = {}
    for r in range(world):
        for key, t in load_file(os.path.join(out, f"{prefix}-{r}.safetensors")).items():
            name, start, _stop, kind = key.split("|")
            parts.setdefault(f"{name}|{kind}", []).append((int(start), t))
    return {k: torch.cat([t.reshape(-1) for _, t in sorted(v, key=lambda p: p[0])]) if not k.split("|")[1].startswith("scalar")
            else sorted(v, key=lambda p: p[0])[0][1] for k, v in parts.items()}


def dump(model, opt, out: str) -> None:
    """This rank's owned pieces after the last step, once the memory tier's commit is done."""
    opt.engine.memory_tier.wait()
    save_owned(model, opt, out)


def train(model, opt, sched, xs: torch.Tensor, ys: torch.Tensor, start: int, steps: int,
          after: Callable[[int], bool] = lambda done: False, faults: tuple[Fault, ...] = ()) -> bool:
    """Steps ``start`` .. ``steps`` (rank-dependent batches), each committed to the memory tier
    (every K-th: ``every``); ``after`` says whether to stop (a handoff). True when stopped."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, steps):
        i = (step * world + rank) * 4 % 512
        loss = ((model(xs[i:i + 4]) - ys[i:i + 4]) ** 2).mean()
        for fault in faults:  # mid-step, after the forward: the scheduler's SIGTERM
            fault.maybe_fire(rank, step + 1)
        opt.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        zeroshard.memory_checkpoint(step + 1, model=model, optimizer=opt, scheduler=sched)
        if after(step + 1):
            return True
    return False


def smaller_world(leaving: list[int], store: str) -> int:
    """The staying ranks as a new, smaller job in the same processes (what a restart at the
    smaller world starts with, without relaunching): a fresh process group among them. Returns
    this rank in it."""
    staying = [r for r in range(dist.get_world_size()) if r not in leaving]
    rank = staying.index(dist.get_rank())
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store, len(staying)), rank=rank, world_size=len(staying))
    return rank


def lose(tier: str, ranks: str) -> None:
    """Deletes the tier directories of ``ranks`` (comma-separated): their node's memory is gone."""
    for r in ranks.split(","):
        shutil.rmtree(os.path.join(tier, f"rank-{r}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", required=True)
    ap.add_argument("--load-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--save-root", default=None)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--term-ranks", default="", help="ranks that get SIGTERM mid-step --term-at (comma-separated)")
    ap.add_argument("--term-at", type=int, default=-1)
    ap.add_argument("--ref-root", default=None, help="then, in the same processes: the reference, resumed from this "
                    "disk checkpoint with a fresh tier (--ref-tier), trained to --steps (ref-*.safetensors/json)")
    ap.add_argument("--ref-tier", default=None)
    ap.add_argument("--parity", type=int, default=0, help="PeerRedundancy(parity=g)")
    ap.add_argument("--lose", default="", help="at --kill-at (instead of a SIGKILL): these ranks' tier directories "
                    "are deleted (a lost node's memory) after every rank dumped its owned pieces (at-kill-*.safetensors); "
                    "then a fresh model resumes (resume-*-1.json, resumed-*.safetensors) and trains to the end")
    ap.add_argument("--shrink", action="store_true", help="after a handoff (its pieces: handoff-*.safetensors) the signalled "
                    "ranks delete their tier directories and exit; the others go on as a smaller job in the same "
                    "processes (resume-*-smaller.json, smaller-resumed-*.safetensors, final-*.safetensors)")
    ap.add_argument("--ref-lose", default="", help="before the reference, these ranks' tier directories are deleted")
    a = ap.parse_args()
    setup_distributed(120.0)  # (each torchrun attempt in its own store key space)
    rank = dist.get_rank()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt == "0"
    model, opt, sched = build(a.tier, a.stage, a.every, a.parity)
    gen = torch.Generator().manual_seed(123)
    xs, ys = torch.randn(512, 16, generator=gen), torch.randn(512, 8, generator=gen)
    torch.manual_seed(100 + rank)  # each rank's dropout differs (the RNG is part of the state)
    roots = [os.path.realpath(r) + os.sep for r in (a.load_root, a.ref_root) if r]
    opened: list[str] = []  # files under the disk roots this process opens (Python's audit events)
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args and isinstance(
        args[0], (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(args[0])).startswith(tuple(roots)) else None)
    start = resume(a.load_root, model, opt, sched, opened, os.path.join(a.out, f"resume-{rank}-{attempt}.json"))
    # Only where the job tests a preemption: a handler that keeps SIGTERM would keep a survivor
    # alive for seconds after torchrun's SIGTERM when another rank was killed (each restart).
    preemption = PreemptionHandler(grace_s=60).install() if a.term_ranks else None
    faults = tuple(Fault("sigterm", int(r), a.term_at) for r in a.term_ranks.split(",") if r) if first else ()

    lost: list[int] = []

    def save_or_kill(done: int) -> bool:
        if first and done == a.save_at:
            zeroshard.save_checkpoint(a.save_root, done, model=model, optimizer=opt, scheduler=sched)
        if first and done == a.kill_at:
            opt.engine.memory_tier.wait()  # (the test kills after step k is committed everywhere)
            if a.lose:  # a lost node's memory, in the same processes: the caller rebuilds and resumes
                save_owned(model, opt, os.path.join(a.out, f"at-kill-{rank}.safetensors"))
                with open(os.path.join(a.out, f"tier-{rank}.json"), "w") as f:
                    json.dump(opt.engine.memory_tier.report(), f)
                dist.barrier()
                if rank == 0:
                    lose(a.tier, a.lose)
                dist.barrier()
                lost.append(done)
                return True
            dist.barrier()
            if rank == a.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        if preemption is None:
            return False
        stop, _ = preemption.agree()  # (the loop's step boundary: every rank sees the same answer)
        if stop:
            info = zeroshard.memory_handoff(done, preemption=preemption, model=model, optimizer=opt, scheduler=sched)
            with open(os.path.join(a.out, f"handoff-{rank}.json"), "w") as f:
                json.dump({k: info[k] for k in ("step", "handed_off", "leaving", "pairs")}, f)
            save_owned(model, opt, os.path.join(a.out, f"handoff-{rank}.safetensors"))
            if not info["handed_off"]:
                zeroshard.save_checkpoint(a.save_root, done, model=model, optimizer=opt, scheduler=sched)
        return stop
    stopped = train(model, opt, sched, xs, ys, start, a.steps, save_or_kill, faults) and not lost
    if lost:  # a fresh model, optimizer and tier object resume (memory tiers first) and train to the end
        model, opt, sched = build(a.tier, a.stage, a.every, a.parity)
        torch.manual_seed(100 + rank)
        start = resume(a.load_root, model, opt, sched, opened, os.path.join(a.out, f"resume-{rank}-1.json"))
        save_owned(model, opt, os.path.join(a.out, f"resumed-{rank}.safetensors"))
        stopped = train(model, opt, sched, xs, ys, start, a.steps, save_or_kill, faults)
    if stopped and a.shrink:  # the node leaves with its memory, the others go on at the smaller world
        if preemption.requested:
            shutil.rmtree(os.path.join(a.tier, f"rank-{rank}"))
        flags: list = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(preemption.requested))
        stopped = bool(preemption.requested)
        if not stopped:
            rank = smaller_world([r for r, f in enumerate(flags) if f], os.path.join(a.out, "smaller-world.store"))
            model, opt, sched = build(a.tier, a.stage, a.every, a.parity if dist.get_world_size() > 1 else 0)
            torch.manual_seed(100 + rank)  # (as a fresh process)
            start = resume(a.load_root, model, opt, sched, opened, os.path.join(a.out, f"resume-{rank}-smaller.json"))
            save_owned(model, opt, os.path.join(a.out, f"smaller-resumed-{rank}.safetensors"))
            train(model, opt, sched, xs, ys, start, a.steps)
    if stopped:
        dist.destroy_process_group()
        return  # (preempted: exit 0)
    dump(model, opt, os.path.join(a.out, f"final-{rank}.safetensors"))
    if a.ref_root is not None:  # the disk resume of the same step, in a fresh model, optimizer and tier
        if a.ref_lose:
            dist.barrier()
            if rank == 0:
                lose(a.ref_tier, a.ref_lose)
            dist.barrier()
        model, opt, sched = build(a.ref_tier, a.stage, parity=a.parity)
        torch.manual_seed(100 + rank)  # as a fresh process (a resharding load keeps this rank's RNG)
        start = resume(a.ref_root, model, opt, sched, opened, os.path.join(a.out, f"ref-resume-{rank}.json"))
        train(model, opt, sched, xs, ys, start, a.steps)
        dump(model, opt, os.path.join(a.out, f"ref-final-{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
