"""A 2-rank stage-2 job as people write it, ended with or without the user's own
``dist.destroy_process_group()`` (issue 43; Note [clean exit] in zeroshard/comm/clean_exit.py).

Six steps, a ``save_checkpoint`` every two, then the script ends. Two launchers:

- ``python tests/support/exit_endings_worker.py spawn ENDING ROOT``: ``torch.multiprocessing.spawn``
  of two processes, each calling ``init_process_group("gloo")`` itself;
- ``python -m torch.distributed.run --nproc-per-node 2 tests/support/exit_endings_worker.py torchrun
  ENDING ROOT``.

``ENDING`` is ``destroy`` (the script's last line is ``dist.destroy_process_group()``) or
``plain`` (it just ends). Each rank writes ``ROOT/workers-at-exit.rank<r>``: the collective
worker threads still alive once zeroshard's exit hook has run (0: none can abort the exit).
benchmarks/check_exit_endings.py runs it many times and counts aborts.
"""
from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # (mp.spawn's children import this file by path)
    sys.path.append(REPO)

import zeroshard  # noqa: E402
from tests.support.models import TinyNet, batch  # noqa: E402


def _report_workers(root: str, rank: int) -> None:
    """At exit, after zeroshard's own exit hook (registered later, so run earlier): how many
    collective worker threads are still alive, i.e. could still drop a work during
    finalization (Note [clean exit])."""
    from zeroshard.comm.clean_exit import _worker_threads
    with open(os.path.join(root, f"workers-at-exit.rank{rank}"), "w") as f:
        f.write(str(len(_worker_threads())))


def train(root: str, destroy: bool) -> None:
    atexit.register(_report_workers, root, dist.get_rank())
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-2)
    for step in range(6):
        model(batch(step * dist.get_world_size() + dist.get_rank(), 4)).backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:
            zeroshard.save_checkpoint(os.path.join(root, "ckpt"), step, model=model, optimizer=opt)
    if destroy:
        dist.destroy_process_group()


def spawned(rank: int, world: int, port: int, root: str, destroy: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train(root, destroy)


def main() -> None:
    launcher, ending, root = sys.argv[1], sys.argv[2], sys.argv[3]
    if ending not in ("destroy", "plain"):
        raise ValueError(f"ending={ending!r}; use 'destroy' or 'plain'")
    destroy = ending == "destroy"
    if launcher == "torchrun":
        dist.init_process_group("gloo")
        train(root, destroy)
    elif launcher == "spawn":
        from zeroshard.testing.launch import free_port
        mp.spawn(spawned, args=(2, free_port(), root, destroy), nprocs=2)
    else:
        raise ValueError(f"launcher={launcher!r}; use 'spawn' or 'torchrun'")


if __name__ == "__main__":
    main()
