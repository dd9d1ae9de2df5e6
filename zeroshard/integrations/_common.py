"""What the Trainer, Accelerate and Lightning integrations share: complete checkpoints from
libraries that write them on rank 0 only.

Note [rank-0 saves]: the three libraries save an optimizer by calling ``optimizer.state_dict()``
and writing the result from rank 0 (the Trainer calls it on rank 0 only; Accelerate and
Lightning on every rank but write rank 0's). A ``ZeroOptimizer.state_dict()`` is this rank's
shard, so such a file would lose every other rank's state, and a stage-3 ``model.state_dict()``
is this rank's pieces. ``SaveGuard`` fixes both through public hooks, at the points where every
rank takes part in a save (a Trainer callback before the save, Accelerate's save-state pre-hook,
the Lightning strategy):

- ``arm()`` (a collective) builds, on rank 0, the consolidated optimizer state (the format of a
  plain ``torch.optim`` optimizer, which every rank's ``load_state_dict`` cuts its own shard
  from, at any world size or stage) and, at stage 3, the full weights;
- the optimizer's state-dict post-hook returns that consolidated state while armed, and the
  model's state-dict post-hook puts the full weights in place of the pieces;
- unarmed, at more than one rank, the shard carries a marker that refuses to be pickled, so
  ``torch.save(optimizer.state_dict())`` fails *when saving*, naming the fix, instead of writing
  a file that fails (or silently loses state) at resume. In-memory round trips (Accelerate's
  ``prepare`` does one) are unaffected.

Consolidating costs rank 0 the whole optimizer state in memory for the save (as FSDP's full
state dicts do); ``zeroshard.save_checkpoint`` writes each rank's shard without that.
"""
from __future__ import annotations

from typing import Any, Optional, SupportsIndex

from torch import nn

from zeroshard.optim import registry
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.optim.shard_marker import REFUSED_KEY  # (the marker's key: Note [rank-only state dicts])

_GUARDS: dict[int, "SaveGuard"] = {}


class _RefusedSave:
    """Stands in a rank's shard: pickling it (torch.save) raises with the fix."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        raise RuntimeError(self.message)

    def __deepcopy__(self, memo: dict) -> "_RefusedSave":
        return self

    def __repr__(self) -> str:
        return "<zeroshard: this rank's shard only; see Note [rank-0 saves]>"




class SaveGuard:
    """One per ZeroOptimizer; see Note [rank-0 saves]. ``fix`` says what the user should do."""

    def __init__(self, optimizer: ZeroOptimizer, fix: str) -> None:
        self.optimizer = optimizer
        self.fix = fix
        self.optimizer_state: Optional[dict] = None
        self.model_state: Optional[dict] = None
        self.armed = False
        optimizer.register_state_dict_post_hook(lambda opt, sd: self._optimizer_state_dict(sd))
        model = optimizer.engine.module
        if model is not None and optimizer.engine.shards_parameters:
            model.register_state_dict_post_hook(lambda mod, sd, prefix, meta: self._model_state_dict(sd, prefix))

    @classmethod
    def install(cls, optimizer: ZeroOptimizer, fix: str) -> "SaveGuard":
        """The guard of ``optimizer``, created once (integrations may be set up twice)."""
        guard = _GUARDS.get(id(optimizer))
        if guard is None or guard.optimizer is not optimizer:
            guard = _GUARDS[id(optimizer)] = cls(optimizer, fix)
        return guard

    @property
    def world_size(self) -> int:
        return self.optimizer.engine.comm.world_size

    def arm(self, optimizer: bool = True, weights: bool = True) -> None:
        """A collective: every rank must call it. Rank 0 keeps the consolidated optimizer state
        (if ``optimizer``) and at stage 3 the full weights (if ``weights``) until ``disarm``."""
        from zeroshard import full_state_dict
        if optimizer:
            self.optimizer_state = self.optimizer.consolidated_state_dict(to_rank=0)
            self.armed = True
        module = self.optimizer.engine.module
        if weights and self.optimizer.engine.shards_parameters and module is not None:
            self.model_state = full_state_dict(module, rank0_only=True)

    def disarm(self) -> None:
        self.optimizer_state = self.model_state = None
        self.armed = False

    def _optimizer_state_dict(self, sd: dict) -> Optional[dict]:
        if self.optimizer_state is not None:  # armed, rank 0: the whole state
            return dict(self.optimizer_state)
        if self.world_size > 1 and not self.armed:  # (armed, other ranks: not written)
            sd[REFUSED_KEY] = _RefusedSave(
                f"refusing to save ZeroOptimizer.state_dict() of rank {self.optimizer.engine.comm.rank}: it holds only "
                f"this rank's shard of {self.world_size}, so a file written from one rank would lose the others' "
                f"optimizer state. {self.fix}")
        elif self.armed:  # (other ranks while armed: rank 0 writes the whole state; nothing to agree on)
            sd.pop(REFUSED_KEY, None)
        return sd

    def _model_state_dict(self, sd: dict, prefix: str) -> None:
        if prefix or self.model_state is None:
            return  # (the root module's call only; the armed full weights live on rank 0)
        for key in list(sd):
            if key in self.model_state:
                sd[key] = self.model_state[key]


def optimizer_of(model: Optional[nn.Module] = None, optimizer: Any = None) -> ZeroOptimizer:
    """The ZeroOptimizer behind ``optimizer`` (possibly wrapped by a library) or managing ``model``."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer
    found = registry.optimizer_for(_unwrap(model)) if model is not None else None
    if not isinstance(found, ZeroOptimizer):
        raise TypeError(f"no ZeroOptimizer found for model {type(model).__name__ if model is not None else None} "
                        f"or optimizer {type(optimizer).__name__}; build one first: "
                        "opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, ...)")
    return found


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def keep_out_of_ddp(model: nn.Module) -> None:
    """Accelerate (and the Trainer through it) wraps a model in DistributedDataParallel at more
    than one process; DDP would reduce the gradients a second time and, at the end of backward,
    overwrite the averaged ones zeroshard published (the model never trains), and it cannot hold
    stage-3 sharded parameters. Accelerate skips models it has prepared already, which is what a
    ZeroOptimizer-managed model is: placed, and synchronised by its optimizer. There is no public
    switch for this in Accelerate 1.x; this marker is the one it checks (``prepare_model``)."""
    setattr(model, "_is_accelerate_prepared", True)  # (Accelerate's marker: not an attribute nn.Module types)


def check_no_autocast(mixed_precision: Any, where: str) -> None:
    """A model kept out of ``prepare`` is not wrapped in the library's autocast either."""
    if str(mixed_precision) not in ("no", "None", "fp32", "32", "32-true"):
        raise ValueError(f"{where} mixed_precision={mixed_precision!r} is not applied to a model trained by a "
                         "ZeroOptimizer; use ZeroOptimizer(model, ..., mixed_precision='bf16' or 'fp16') instead "
                         "and leave the library in fp32")


def is_zero(optimizer: object) -> bool:
    try:
        optimizer_of(None, optimizer)
        return True
    except TypeError:
        return False


def full_weights_for_save(model: nn.Module) -> Optional[dict]:
    """Stage 3: the full weights on rank 0 (None elsewhere); stages 0-2: None (state_dict is full)."""
    opt = registry.optimizer_for(_unwrap(model))
    if opt is None or not opt.engine.shards_parameters:
        return None
    from zeroshard import full_state_dict
    return full_state_dict(_unwrap(model), rank0_only=True)


__all__ = ["SaveGuard", "optimizer_of", "keep_out_of_ddp", "check_no_autocast", "full_weights_for_save",
           "REFUSED_KEY", "is_zero"]
