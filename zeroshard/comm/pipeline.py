"""Pipeline parallelism: ZeRO over the "dp" dimension of a ("pp", "dp"[, "tp"]) mesh.

Note [pipeline parallelism]: torch's ``torch.distributed.pipelining`` drives the forward and
backward of each micro-batch across the stages; each rank holds one stage's module and builds
``ZeroOptimizer(stage_module, ..., mesh=mesh)`` with the whole mesh. zeroshard shards that
stage's parameters, gradients and optimizer state over "dp" only (tp as in Note
[tensor-parallel parameters]); the "pp" dimension is recorded here and used where a decision
spans the whole model, not one stage:

- gradients: the schedule runs one backward per micro-batch. Reducing each would cost
  n_microbatches reductions per step, so ``PipelineStage`` (this file; torch's with one method
  changed) runs every backward but the last with the reducer deferred (Note [deferred
  reduction] in zeroshard/grads/reducer.py): their gradients add into the unit buckets
  locally, and the last micro-batch's backward reduces each unit once, as soon as it is
  complete, overlapped with the rest of that backward. torch's schedules call the method
  with ``last_backward`` (GPipe, 1F1B). torch's own
  ``PipelineStage`` still trains correctly, with one reduction per micro-batch;
- clipping: the norm's partial sums (dp, then tp) are summed over pp as well, so every stage
  clips by the norm of the whole model (zeroshard/grads/norm.py);
- fp16: the overflow found on any rank of any stage skips the step on all of them, and the
  loss scale is the same on every stage (the last stage scales the loss, the others receive
  scaled gradients), so every stage's scaler moves alike;
- checkpoints: every rank of the mesh writes its pieces; names are the full model's (the
  stage module keeps the full model's names for its parameters, e.g. the layers it holds under
  a ModuleDict keyed by their index), the manifest's tensor table and param groups are the
  union over stages, each stage's first rank writes its stage's buffers, and a load at any
  other layout (another pp, dp, one process) reads the names it holds
  (zeroshard/checkpoint/saver.py, load.py);
- reports: ``comm_report`` lists the pp group's traffic (the norm's and the fp16 flag's sums)
  as "@pp"; activations travel through torch's pipelining, not zeroshard, and are not in it.

Stage 3 is refused with pp: its parameters are gathered per unit in forward and released
after the unit's backward, which a schedule runs once per micro-batch, so gathers would be
2 x n_microbatches per step (FSDP2 offers ``reshard_after_forward=False`` for this case, which
keeps the stage's whole parameters between forward and backward: stage 2's memory). And with
deferred reduction the stage's unsharded gradient sums are held between micro-batches anyway.
Schedules that split backward into input and weight parts (zero bubble) are refused: their
weight gradients reach ``.grad`` outside the hooks the reducer counts on. So are several
stages per rank (interleaved schedules): each stage's optimizer would clip by its own
stages' norm.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from zeroshard.comm.process_group import Comm

_BackwardResult = tuple[tuple[Optional[torch.Tensor], ...], Optional[list[dict[str, object]]]]


@dataclass(frozen=True)
class PipelineParallel:
    """The pp side of a ZeroOptimizer: the group of this rank's peers in the other stages
    (same dp and tp coordinates), this rank's stage, and who writes what to checkpoints. Read
    from the mesh by comm/mesh.py's ``mesh_info`` (Note [the mesh variant is the type])."""

    comm: Comm
    stage: int
    stages: int
    checkpoint_ranks: tuple[int, ...]
    """Every rank of the mesh: they all write checkpoint files."""
    writes_full: bool
    """This rank writes its stage's unsharded tensors (buffers): dp (and tp) coordinate 0."""


# Note [deferring a stage's reductions]: ``PipelineStage`` (below) must reach the gradient
# reducer of the ZeroOptimizer that trains its ``submod``, and check its stage count against
# that optimizer's mesh, but comm/ sits below the optimizer (Note [the layers] in
# docs/design.md). So the engine's assembly registers, per module it manages, how to defer its
# reductions and its pipeline stage (``defer_reductions``; the method held weakly: the entry
# never keeps an optimizer alive) and the stage looks that up; a module no ZeroOptimizer trains
# has none.
_DEFERRALS: "weakref.WeakKeyDictionary[nn.Module, tuple[weakref.WeakMethod, Optional[PipelineParallel]]]" = \
    weakref.WeakKeyDictionary()


def defer_reductions(module: nn.Module, deferred: Callable[[bool], ContextManager[None]],
                     pp: Optional[PipelineParallel]) -> Callable[[], None]:
    """Registers ``deferred`` (a bound method: ``GradientReducer.deferred``) and the optimizer's
    pipeline stage (None without a "pp" mesh dimension) for ``module``; returns what removes the
    entry again (the optimizer's teardown runs it)."""
    entry = (weakref.WeakMethod(deferred), pp)  # type: ignore[arg-type]
    _DEFERRALS[module] = entry

    def remove() -> None:
        if _DEFERRALS.get(module) is entry:
            del _DEFERRALS[module]
    return remove


def _registered(module: nn.Module) -> tuple[Optional[Callable[[bool], ContextManager[None]]], Optional[PipelineParallel]]:
    """(the reducer's ``deferred``, the pipeline stage) a live ZeroOptimizer registered for ``module``."""
    entry = _DEFERRALS.get(module)
    deferred = entry[0]() if entry is not None else None
    return (deferred, entry[1]) if entry is not None and deferred is not None else (None, None)


# Note [pipelining imported on first use]: torch.distributed.pipelining imports torch._dynamo,
# 1.5 s of CPU per process, and every rank of every run imports this file (the mesh reads
# ``PipelineParallel``); so ``PipelineStage``, torch's class with one method changed, is built
# the first time it is read (``from zeroshard.comm.pipeline import PipelineStage`` as before).
def _build_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

    class PipelineStage(_TorchPipelineStage):
        """torch's ``PipelineStage`` whose micro-batches but the last add their gradients locally,
        so a stage module trained by a ZeroOptimizer reduces its gradients once per step (Note
        [pipeline parallelism]). Same arguments as torch's; the stage count is checked against the
        pp group (and the ZeroOptimizer's mesh) as it is built: a count the ranks cannot hold makes
        torch's schedule send to the wrong peer, and gloo aborts the process ("collective mismatch")."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # (torch's own arguments; no collective)
            check_stage_count(self.submod, self.stage_index, self.num_stages, self.group_size)

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                       last_backward: bool = False) -> _BackwardResult:
            deferred, _ = _registered(self.submod)
            if deferred is None:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if self.num_stages != self.group_size:  # (each stage's own clip would see half the model's norm)
                raise RuntimeError(f"{self.num_stages} pipeline stages over {self.group_size} ranks: a ZeroOptimizer "
                                   "trains one stage module per rank (its norm and fp16 decisions span the pp group "
                                   "once); use ScheduleGPipe or Schedule1F1B with one stage per rank")
            if backward_type != "full":
                raise RuntimeError(f"a pipeline schedule asked for a {backward_type!r} backward (a zero-bubble schedule "
                                   "splits backward into input and weight parts); ZeroOptimizer reduces gradients in "
                                   "the hooks of a full backward: use ScheduleGPipe or Schedule1F1B")
            with deferred(not last_backward):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return PipelineStage


def __getattr__(name: str) -> type:
    if name != "PipelineStage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    built = _build_stage_class()
    globals()["PipelineStage"] = built
    return built


def check_stage_count(submod: torch.nn.Module, stage_index: int, num_stages: int, group_size: int) -> None:
    """Refuses a stage count that does not fit the pp group: torch's schedules hold stage ``s``
    on group rank ``s % group_size``, so the count is a multiple of the group's size; and a
    stage module a ZeroOptimizer trains is one stage per rank of its mesh's "pp" dimension."""
    if num_stages % group_size != 0:
        raise ValueError(f"PipelineStage(stage_index={stage_index}, num_stages={num_stages}) over a pp group of "
                         f"{group_size} ranks: torch's schedules hold stage s on rank s % {group_size}, so "
                         f"num_stages must be a multiple of {group_size} (with a ZeroOptimizer: num_stages="
                         f"{group_size}, the mesh's 'pp' size)")
    deferred, pp = _registered(submod)  # (Note [deferring a stage's reductions])
    if deferred is None:
        return  # (torch's own use; a ZeroOptimizer built later is checked at the first backward)
    stages = pp.stages if pp is not None else 1
    if num_stages != group_size or num_stages != stages or (pp is not None and stage_index != pp.stage):
        where = f"stage {pp.stage} of {pp.stages}" if pp is not None else "a mesh without a 'pp' dimension"
        raise ValueError(f"PipelineStage(stage_index={stage_index}, num_stages={num_stages}) over a pp group of "
                         f"{group_size} ranks, for a module whose ZeroOptimizer's mesh puts this rank at {where}: "
                         "a ZeroOptimizer trains one stage module per rank (its norm and fp16 decisions span the "
                         "pp group once); pass stage_index=mesh.get_local_rank('pp') and num_stages="
                         "mesh['pp'].size() and use ScheduleGPipe or Schedule1F1B")
