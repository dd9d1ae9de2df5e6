"""The small state of a load (hyperparameters, loss scaler, scheduler, data position, RNG):
decoded and checked against the live objects before anything is applied, then applied
all together with a way back.

Why two steps: the live objects' ``load_state_dict`` are other people's code and may
refuse a value (a sampler built for another dataset); applying them before the tensors,
with a snapshot to restore, means such a refusal leaves model, optimizer and every other
object as they were, on every rank (the caller agrees on the outcome before going on).
"""
from __future__ import annotations

import copy
import os
import random
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from zeroshard.checkpoint import group_names, jsontree, manifest, rng
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError
from zeroshard.checkpoint.shard_file import read_json
from zeroshard.checkpoint.validate import compatible
from zeroshard.optim.state_io import apply_group_options, apply_loss_scaler

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


@dataclass
class TrainerPlan:
    """Decoded, checked values a load will apply (None: leave that object alone)."""

    groups: Optional[list[dict]]
    scaler: Optional[dict]
    scheduler: Optional[dict]
    dataloader: Any
    dataloader_resharded: bool
    rng: Optional[dict]
    extra: Any


def prepare(body: dict, opt: Any, scheduler: Any, dataloader: Any, src_dir: str, rank: int, world: int,
            load_rng: bool, group_names_held: list[list[str]], rng_states: Optional[list] = None) -> TrainerPlan:
    """Raises CheckpointCorruptError (malformed: the root falls back) or CheckpointMismatchError
    (the caller passed an object the checkpoint holds no state for). ``group_names_held``: the
    checkpoint names each of the optimizer's groups trains (Note [param groups by name]).
    ``rng_states``: every saved rank's RNG state, given (the memory tier) instead of read from files."""
    trainer = body["trainer"]
    same_world = body["world_size"] == world
    where = os.path.join(src_dir, manifest.MANIFEST)
    groups = scaler = sched = loader = None
    if opt is not None:
        saved_groups = jsontree.decode(body.get("param_groups", []), f"{where}: param_groups")
        groups = [g or {} for g in group_names.resolve(saved_groups, group_names_held, where)]
        for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
            for k, v in saved.items():
                if k != "params" and k in mine:
                    compatible(mine[k], v, f"{where}: param_groups[{i}][{k!r}]")
        if opt.engine.scaler is not None and trainer.get("loss_scaler"):
            scaler = trainer["loss_scaler"]
            compatible(opt.engine.scaler.state_dict(), scaler, f"{where}: trainer.loss_scaler")
    if scheduler is not None:
        if trainer.get("scheduler") is None:
            raise CheckpointMismatchError(f"{src_dir} holds no scheduler state; pass scheduler=None")
        sched = jsontree.decode(trainer["scheduler"], f"{where}: trainer.scheduler")
        compatible(scheduler.state_dict(), sched, f"{where}: trainer.scheduler")
    states = trainer.get("dataloader") or []
    if dataloader is not None:
        if not states or states[0] is None:
            raise CheckpointMismatchError(f"{src_dir} holds no data position; pass dataloader=None")
        loader = jsontree.decode(states[rank if same_world else 0], f"{where}: trainer.dataloader")
        if loader is None:
            raise CheckpointMismatchError(f"{src_dir} holds no data position for rank {rank}")
        if hasattr(dataloader, "state_dict"):
            compatible(dataloader.state_dict(), loader, f"{where}: trainer.dataloader")
    # Every saved RNG file is checked (rank r of this world takes r, r + world, ...), needed
    # or not: a step with a malformed file is damaged, whatever world size loads it.
    state = None
    for r in range(rank, body["world_size"], world):
        fname = manifest.rng_file(r)
        path = os.path.join(src_dir, fname)
        checked = rng.check(read_json(path, body["files"][fname]) if rng_states is None else rng_states[r], path)
        if r == rank and same_world and load_rng:
            state = checked
    extra = jsontree.decode(trainer.get("extra"), f"{where}: trainer.extra")
    return TrainerPlan(groups, scaler, sched, loader, not same_world, state, extra)


def apply(plan: TrainerPlan, opt: Any, scheduler: Any, dataloader: Any) -> tuple[Optional[str], Callable[[], None]]:
    """Applies the plan; returns (error or None, undo). On an error the plan is already
    undone; ``undo`` puts everything back if another rank failed."""
    undo = _snapshot(opt, scheduler, dataloader)
    try:
        if plan.groups is not None:
            apply_group_options(opt, plan.groups)
        if plan.scaler is not None:
            apply_loss_scaler(opt, plan.scaler)
        if plan.scheduler is not None:
            scheduler.load_state_dict(plan.scheduler)
        if plan.dataloader is not None:
            if plan.dataloader_resharded and not getattr(dataloader, "reshardable", False):
                warnings.warn(f"{type(dataloader).__name__} state was saved at another world size; using "
                              "rank 0's position (a ResumableSampler reshards exactly)", stacklevel=4)
            dataloader.load_state_dict(plan.dataloader)
        if plan.rng is not None:
            rng.restore(plan.rng)
    except Exception as exc:  # noqa: BLE001 - a live object refused its state: undo, report
        undo()
        return f"{type(exc).__name__}: {exc}", undo
    return None, undo


def _snapshot(opt: Optional["ZeroOptimizer"], scheduler: Any, dataloader: Any) -> Callable[[], None]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt is not None else None
    scaler = copy.deepcopy(opt.engine.scaler.state_dict()) if opt is not None and opt.engine.scaler is not None else None
    sched = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    loader = copy.deepcopy(dataloader.state_dict()) if hasattr(dataloader, "state_dict") else None
    gens = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    def undo() -> None:
        if groups is not None and opt is not None:  # (groups and scaler were taken from opt)
            apply_group_options(opt, groups, replace=True)
        if scaler is not None and opt is not None:
            apply_loss_scaler(opt, scaler)
        if sched is not None:
            scheduler.load_state_dict(sched)
        if loader is not None:
            dataloader.load_state_dict(loader)
        random.setstate(gens[0])
        np.random.set_state(gens[1])
        torch.set_rng_state(gens[2])
    return undo
