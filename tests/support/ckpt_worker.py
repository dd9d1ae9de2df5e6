"""Rank-side training loops for the checkpoint tests: train, save, SIGKILL, resume, reshard.

Each function runs inside ``zeroshard.testing.launch.spawn`` and writes JSON results (losses, final
parameters as hex of their bytes) that the pytest side compares bit for bit.
"""
from __future__ import annotations

import json
import os
import signal
from typing import Optional

import torch
import torch.nn.functional as F

import zeroshard
from tests.support.models import SEQ, VOCAB, TinyNet, param_groups
from zeroshard.data import ResumableSampler

GLOBAL_BATCH = 8
DATASET = 40  # 5 steps per epoch at the global batch: runs cross epoch boundaries


class DropoutNet(TinyNet):
    """TinyNet with dropout, so resuming must restore the RNG to match."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.emb(tokens), p=0.2, training=self.training)
        h = h + self.frozen(h)
        h = torch.tanh(self.norm(self.fc1(h))) * self.gain
        h = torch.cat([h[..., :3] * self.mix, h[..., 3:]], dim=-1)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB).float(), tokens.roll(1, -1).reshape(-1)) + \
            self.fc2(h).pow(2).mean().float()


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (DATASET, SEQ), generator=g))


class Trainer:
    """Model, ZeroOptimizer, scheduler and data of one run."""

    def __init__(self, world: int, stage: int, precision: Optional[str] = None, seed: int = 0,
                 dropout: bool = True, grouped: bool = True) -> None:
        torch.manual_seed(seed)
        self.model = DropoutNet()
        self.model.train(dropout)  # reshard runs compare across world sizes, whose RNG streams differ
        # Stage 3 partitions by module, so it takes the model (one param group).
        params = param_groups(self.model, named=True) if grouped and stage != 3 else self.model
        self.opt = zeroshard.ZeroOptimizer(params, torch.optim.AdamW,
                                           stage=stage, mixed_precision=precision, bucket_size_mb=0.001,
                                           lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + 0.1 * s))
        self.sampler = ResumableSampler(DATASET, shuffle=True, seed=3)
        # A DataLoader draws a seed from the global torch RNG each time an iterator starts,
        # which a resumed run does at a different step: give it its own generator.
        self.loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // world,
                                                  sampler=self.sampler, generator=torch.Generator())
        self.step = 0
        self.losses: list[float] = []

    def train(self, until: int, on_step=None) -> None:
        """Trains to global step ``until``; ``on_step(trainer)`` runs after each step."""
        while self.step < until:
            for (x,) in self.loader:
                loss = self.model(x)
                loss.backward()
                self.opt.clip_grad_norm_(0.5)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
                self.losses.append(loss.item())
                self.step += 1
                if on_step is not None:
                    on_step(self)
                if self.step >= until:
                    return
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def save(self, root: str, **kw) -> None:
        # `extra` is global (rank 0's): carry every rank's local losses in it. The frozen layer
        # is saved too, so every consumer (export included) sees a whole model; the default,
        # lean checkpoints are tests/integrations/test_lora.py's.
        kw.setdefault("save_frozen", True)
        losses = self.opt.engine.comm.all_gather_object(self.losses)
        zeroshard.save_checkpoint(root, self.step, model=self.model, optimizer=self.opt, scheduler=self.sched,
                                  dataloader=self.sampler, extra={"losses": losses}, **kw)

    def load(self, root: str) -> dict:
        info = zeroshard.load_checkpoint(root, model=self.model, optimizer=self.opt, scheduler=self.sched,
                                         dataloader=self.sampler)
        self.step = info["step"]
        saved = info["extra"]["losses"]
        # After a reshard the local losses of other world sizes do not apply: keep rank 0's.
        self.losses = list(saved[self.opt.engine.comm.rank] if len(saved) == self.opt.engine.comm.world_size else saved[0])
        return info

    def result(self) -> dict:
        # full_state_dict gathers stage 3's sharded parameters (a collective on every rank).
        state = zeroshard.full_state_dict(self.model, rank0_only=False)
        return {"losses": self.losses, "step": self.step,
                "params": {n: p.contiguous().view(torch.uint8).numpy().tobytes().hex() for n, p in state.items()}}


def _dump(path: str, rank: int, obj: dict) -> None:
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump(obj, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def uninterrupted(rank: int, world: int, stages: list[int], total: int, out: str) -> None:
    res = {}
    for stage in stages:
        t = Trainer(world, stage)
        t.train(total)
        res[stage] = t.result()
    _dump(out, rank, res)


def train_then_kill(rank: int, world: int, stages: list[int], save_at: int, root: str,
                    async_stage: int) -> None:
    """Saves at ``save_at`` for each stage (async for ``async_stage``), trains on, then dies."""
    for stage in stages:
        t = Trainer(world, stage)
        t.train(save_at)
        t.save(os.path.join(root, f"s{stage}"), async_save=stage == async_stage)
        t.train(save_at + 2)  # progress that the kill loses
        zeroshard.wait_checkpoint()
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world: int, stages: list[int], total: int, root: str, out: str) -> None:
    res = {}
    for stage in stages:
        t = Trainer(world, stage, seed=123)  # a different init: everything must come from the checkpoint
        info = t.load(os.path.join(root, f"s{stage}"))
        assert info["rng_restored"], info
        t.train(total)
        res[stage] = t.result()
    _dump(out, rank, res)


def reshard_save(rank: int, world: int, stage: int, save_at: int, root: str, out: str) -> None:
    from zeroshard.checkpoint import shard_file
    shard_file.BLOCK = 1024  # small checksum blocks, so partial reads of this tiny model show
    t = Trainer(world, stage, dropout=False, grouped=False)
    t.train(save_at)
    t.save(root)
    _dump(out, rank, t.result())


def reshard_resume(rank: int, world: int, stage: int, total: int, root: str, out: str) -> None:
    t = Trainer(world, stage, seed=99, dropout=False, grouped=False)
    info = t.load(root)
    t.train(total)
    _dump(out, rank, {**t.result(), "bytes_read": info["bytes_read"]})


def reference(rank: int, world: int, total: int, out: str) -> None:
    t = Trainer(world, 0, dropout=False, grouped=False)
    t.train(total)
    _dump(out, rank, t.result())


def _state_digest(t: Trainer) -> dict:
    """This rank's parameters and optimizer state as hashes of their bytes, and the ids of
    the state tensors (a refused load must neither change nor replace them)."""
    import hashlib

    def digest(x: torch.Tensor) -> str:
        return hashlib.sha256(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    state = [(k, v) for run in t.opt.engine.joined().runs for k, v in sorted(t.opt.inner.state.get(run.tensor, {}).items())]
    return {"params": {n: digest(p) for n, p in t.model.named_parameters()},
            "masters": [digest(u.master) for u in t.opt.units],
            "state": [digest(v) for _, v in state], "ids": [id(v) for _, v in state]}


def damaged_peer(rank: int, world: int, out: str, root: str) -> None:
    """Saves at stage 2, flips the last byte of the last rank's data file and loads it: that
    rank finds the damage after the others verified (and could adopt) all of theirs, and no
    rank may change or replace a live tensor. Then the repaired step loads bit for bit."""
    from zeroshard.checkpoint import CheckpointCorruptError
    t = Trainer(world, 2, dropout=False, grouped=False)
    t.train(2)
    t.save(root)
    zeroshard.wait_checkpoint()
    saved = _state_digest(t)
    t.train(3)  # the live state moves on from the checkpoint
    step = os.path.join(root, "step-00000002")
    path = os.path.join(step, f"rank-{world - 1:05d}.safetensors")
    if rank == 0:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    torch.distributed.barrier()
    before = _state_digest(t)
    try:
        t.load(step)
        refused = None
    except CheckpointCorruptError as exc:
        refused = str(exc)
    untouched = _state_digest(t) == before
    torch.distributed.barrier()
    if rank == 0:  # repaired: now it loads, adopting the verified moments
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(last)
    torch.distributed.barrier()
    live = {id(v) for run in t.opt.engine.joined().runs for v in t.opt.inner.state[run.tensor].values()}
    t.load(step)
    moments = [v for run in t.opt.engine.joined().runs for k, v in t.opt.inner.state[run.tensor].items() if v.dim() > 0]
    loaded = _state_digest(t)
    _dump(out, rank, {"refused": refused, "untouched": untouched,
                      "restored": {k: loaded[k] for k in ("params", "masters", "state")} ==
                      {k: saved[k] for k in ("params", "masters", "state")},
                      # a copy writes into the live tensors; adopting replaces them
                      "adopted": sum(id(v) not in live and v.untyped_storage().nbytes() == v.nbytes for v in moments),
                      "moments": len(moments)})
