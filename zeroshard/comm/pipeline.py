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
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch
from torch import nn

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from zeroshard.comm.process_group import Comm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.config import ZeroConfig

_BackwardResult = tuple[tuple[Optional[torch.Tensor], ...], Optional[list[dict[str, object]]]]


@dataclass(frozen=True)
class PipelineParallel:
    """The pp side of a ZeroOptimizer: the group of this rank's peers in the other stages
    (same dp and tp coordinates), this rank's stage, and who writes what to checkpoints."""

    comm: Comm
    stage: int
    stages: int
    checkpoint_ranks: tuple[int, ...]
    """Every rank of the mesh: they all write checkpoint files."""
    writes_full: bool
    """This rank writes its stage's unsharded tensors (buffers): dp (and tp) coordinate 0."""


def mesh_dims(mesh: object) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def detect(mesh: Optional["DeviceMesh"], config: "ZeroConfig") -> Optional[PipelineParallel]:
    """The PipelineParallel of a mesh with a "pp" dimension (None without one); refuses a mesh
    of another shape. What pp does not compose with (stage 3, hpZ, NVMe) is refused by
    ``check_composition`` (zeroshard/optim/composition.py; Note [pipeline parallelism])."""
    dims = mesh_dims(mesh)
    if mesh is None or "pp" not in dims:
        return None
    rest = [n for n in dims if n not in ("pp", "tp")]
    if rest != ["dp"]:
        raise ValueError(f"mesh_dim_names={dims}: a pipeline-parallel mesh is ('pp', 'dp') or ('pp', 'dp', 'tp'); "
                         "a hybrid (replicate, shard) data-parallel dimension with pp is not supported yet")
    pp_mesh = mesh["pp"]
    coord = list(mesh.get_coordinate() or ())
    others = [c for n, c in zip(dims, coord) if n != "pp"]
    return PipelineParallel(Comm(pp_mesh.get_group(), dimension="pp"), pp_mesh.get_local_rank(), pp_mesh.size(),
                            tuple(sorted(mesh.mesh.flatten().tolist())), all(c == 0 for c in others))


# Note [deferring a stage's reductions]: ``PipelineStage`` (below) must reach the gradient
# reducer of the ZeroOptimizer that trains its ``submod``, but comm/ sits below the optimizer
# (Note [the layers] in docs/design.md). So the engine's assembly registers, per module it
# manages, how to defer its reductions (``defer_reductions``, held weakly: the entry never keeps
# an optimizer alive) and the stage looks that up; a module no ZeroOptimizer trains has none.
_DEFERRALS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakMethod]" = weakref.WeakKeyDictionary()


def defer_reductions(module: nn.Module, deferred: Callable[[bool], ContextManager[None]]) -> Callable[[], None]:
    """Registers ``deferred`` (a bound method: ``GradientReducer.deferred``) for ``module``; returns
    what removes the entry again (the optimizer's teardown runs it)."""
    ref = weakref.WeakMethod(deferred)  # type: ignore[arg-type]
    _DEFERRALS[module] = ref

    def remove() -> None:
        if _DEFERRALS.get(module) is ref:
            del _DEFERRALS[module]
    return remove


def _deferral(module: nn.Module) -> Optional[Callable[[bool], ContextManager[None]]]:
    ref = _DEFERRALS.get(module)
    return ref() if ref is not None else None


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` whose micro-batches but the last add their gradients locally,
    so a stage module trained by a ZeroOptimizer reduces its gradients once per step (Note
    [pipeline parallelism]). Same arguments as torch's."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> _BackwardResult:
        deferred = _deferral(self.submod)
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
