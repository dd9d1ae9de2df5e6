"""A 2-rank job that trains, saves asynchronously and exits *without* destroy_process_group.

Launched by torchrun (``python -m torch.distributed.run --nproc-per-node 2 tests/support/exit_worker.py
MODE ROOT``) from tests/dist/test_clean_exit.py: the job must exit 0 with nothing on stderr about
``terminate called`` (issue 28, Note [clean exit] in zeroshard/comm/clean_exit.py).

- ``train``: stage 2, then stage 3 with NVMe offload (the I/O engine's threads), three async
  saves each with rotation (the discard thread), the last one still in flight when the
  script's last line returns.
- ``in_flight``: a collective still in flight when the script ends, completed during a slow
  interpreter teardown: the abort's window (a gloo worker dropping a finished work once the
  interpreter is finalizing) held open for a second instead of microseconds.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import zeroshard
from tests.support.models import SEQ, VOCAB, TinyNet


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=g)


def train(root: str, stage: int, offload: bool) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    extra: dict = {}
    if offload:
        swap = os.path.join(root, f"swap-{dist.get_rank()}")
        os.makedirs(swap, exist_ok=True)
        extra = dict(offload_optimizer="nvme", nvme_path=swap)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, **extra)
    g = torch.Generator().manual_seed(dist.get_rank())
    ckpt = os.path.join(root, f"ckpt-s{stage}-{int(offload)}")
    for step in range(3):
        model(_batch(g)).backward()
        opt.step()
        opt.zero_grad()
        zeroshard.save_checkpoint(ckpt, step, model=model, optimizer=opt, async_save=True, keep_last=1)


class SlowTeardown:
    """Held by a module global, so freed during interpreter finalization; sleeping, it releases
    the GIL there, as freeing a large model or flushing a logger may."""

    def __del__(self) -> None:
        time.sleep(0.5)


def in_flight(root: str) -> None:
    """A stage-3 step and an async save, then a gather still in flight when the script ends (as
    a prefetch is when a script stops after a forward). Rank 1 joins it a second late, while
    rank 0 runs Python bytecode to the end of the script with a switch interval of 30 s: the
    gloo worker that completes the gather and drops its temporary slices waits for the GIL
    (Note [clean exit]) and cannot get it before finalization begins, the window of the abort
    held open deterministically instead of for a few microseconds."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    model(_batch(torch.Generator().manual_seed(dist.get_rank()))).backward()
    opt.step()
    zeroshard.save_checkpoint(os.path.join(root, "ckpt"), 0, model=model, optimizer=opt, async_save=True)
    zeroshard.wait_checkpoint()
    full = torch.zeros(opt.engine.comm.world_size * 1024)
    rank = opt.engine.comm.rank
    if rank == 1:
        time.sleep(1.0)
    else:
        sys.setswitchinterval(30.0)
    work = opt.engine.comm.gather_shards(full)
    if rank == 1:
        work.wait()
    del work, full
    until = time.monotonic() + 2.0
    while rank == 0 and time.monotonic() < until:  # (bytecode: holds the GIL, drops it on request only)
        pass
    global _SLOW
    _SLOW = SlowTeardown()


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if mode == "train":
        train(root, stage=2, offload=False)
        train(root, stage=3, offload=True)
    elif mode == "in_flight":
        in_flight(root)
    else:
        raise ValueError(f"mode={mode!r}; use 'train' or 'in_flight'")
    # No destroy_process_group, no wait_checkpoint: a script that just ends.


if __name__ == "__main__":
    main()
