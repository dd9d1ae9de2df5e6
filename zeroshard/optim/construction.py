"""Building a ZeroOptimizer as one transaction: a refused construction leaves the model as it was.

Note [refused construction]: what can be checked before anything is touched is checked first
(arguments, the environment, a kernel NVMe offload needs: params.py, hyperparams.py,
inner_kwargs.py, kernel_choice.py, ddp_check.py). What can only fail later — a swap file on a
full disk, a budget the planner cannot meet, the inner optimizer's own constructor — fails
after parameters were re-registered (meta placeholders, stage-3 sharded parameters), re-pointed
into flat units, or given hooks. ``ModelSnapshot``
records, before the first change, each parameter's registration, data, ``requires_grad`` and
``.grad``; ``abandon`` removes whatever was attached and puts the records back, so every
parameter reads its old values, dtype and storage and ``model(x)`` works as before.

Memory: the record keeps a parameter's old data alive only where its unit cannot give the
exact values back — stage 3 (a rank keeps only its shard) and a parameter cast to the mixed
precision dtype; elsewhere the unit's flat buffer holds the values and a refused construction
copies them out. Frozen weights are cast to the mixed-precision dtype last, once nothing can
refuse any more (``cast_frozen``); until then the planner sees them as they will be
(``as_planned``).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import nn

from zeroshard.comm.process_group import check_launched_with_group
from zeroshard.comm.tensor_parallel import is_dtensor, local_of
from zeroshard.optim import ddp_check
from zeroshard.optim.kernel_choice import check_nvme_kernel
from zeroshard.optim.ownership import _OWNER, take_back_collected

if TYPE_CHECKING:
    from zeroshard.comm.mesh import MeshInfo
    from zeroshard.optim.teardown import Teardown


def _set_local(p: torch.Tensor, data: torch.Tensor) -> None:
    if is_dtensor(p):  # (its local shard: Note [tensor-parallel parameters])
        p._local_tensor = data
    else:
        p.data = data


def _ptr(t: torch.Tensor) -> int:
    local = local_of(t)
    if local.layout != torch.strided:  # (sparse: no storage to point at; refused later by name)
        return id(local)
    return local.untyped_storage().data_ptr()


def tensors_of(model_or_params: Any) -> list[torch.Tensor]:
    """The tensors of what ``check_inputs`` returned (a module's parameters are found through
    its registrations)."""
    if isinstance(model_or_params, nn.Module):
        return []
    out = []
    for item in model_or_params:
        entries = item["params"] if isinstance(item, dict) else [item]
        for e in entries:
            p = e[1] if isinstance(e, tuple) and len(e) == 2 else e
            if isinstance(p, torch.Tensor):
                out.append(p)
    return out


def group_options(model_or_params: Any) -> list[dict]:
    """Each param group's own options (without its parameters); one empty group for a module."""
    if isinstance(model_or_params, nn.Module):
        return [{}]
    return [{k: v for k, v in g.items() if k != "params"} for g in model_or_params if isinstance(g, dict)] or [{}]


class ModelSnapshot:
    """What the construction may change on the model and its parameters (Note [refused construction])."""

    def __init__(self, module: Optional[nn.Module], params: Iterable[torch.Tensor]) -> None:
        self._regs = ([(m, name, p) for m in module.modules() for name, p in m._parameters.items()]
                      if module is not None else [])
        self._saved: dict[int, list] = {}
        for p in [*params, *(p for _, _, p in self._regs)]:
            if isinstance(p, torch.Tensor) and id(p) not in self._saved:
                data = local_of(p).detach() if is_dtensor(p) else p.data
                self._saved[id(p)] = [p, data, _ptr(p), p.requires_grad, p.grad]

    def keep_data_only_of(self, needed: Callable[[torch.Tensor], bool]) -> None:
        """Lets go of the old data of parameters whose values their unit keeps exactly."""
        for rec in self._saved.values():
            if not needed(rec[0]):
                rec[1] = None

    def commit(self) -> None:
        """Nothing can refuse any more: the old data is let go (before the frozen cast, which
        then frees each old tensor as it goes)."""
        self._regs, self._saved = [], {}

    def restore(self) -> None:
        for m, name, p in self._regs:
            m._parameters[name] = p
        with torch.no_grad():
            for p, data, ptr, requires_grad, grad in self._saved.values():
                if data is not None:
                    _set_local(p, data)
                elif _ptr(p) != ptr:  # (a view of its unit's flat buffer, which holds its exact values)
                    _set_local(p, local_of(p).detach().clone())
                p.requires_grad_(requires_grad)
                p.grad = grad
                if hasattr(p, _OWNER):
                    delattr(p, _OWNER)


def check_and_record(config: Any, model_or_params: Any, module: Optional[nn.Module], optimizer_class: type,
                     kwargs: dict) -> "ConstructionRecord":
    """The checks that need no state built (after ``check_inputs``), then the record of the
    construction, starting with the model as it is."""
    ddp_check.refuse_wrapper(model_or_params, "the model")
    ddp_check.refuse_wrapper(module, "module=")
    check_launched_with_group()
    root = module if module is not None else model_or_params if isinstance(model_or_params, nn.Module) else None
    if root is not None:
        take_back_collected(root)
    touched = tensors_of(model_or_params) + (list(root.parameters()) if root is not None else [])
    check_nvme_kernel(config, optimizer_class, kwargs, group_options(model_or_params), touched)
    return ConstructionRecord(ModelSnapshot(root, touched))


_INSTANCES = itertools.count()


class ConstructionRecord:
    """The one mutable record of a construction (the engine itself is built complete at its
    end, Note [assembly]): the model as it was (``snapshot``) and what was attached to it and
    opened since, in order. A refused construction is undone from it (``abandon``); a built
    engine keeps it to close its swap files (a rebuild) and its teardown removes the hooks."""

    def __init__(self, snapshot: ModelSnapshot) -> None:
        self.snapshot = snapshot
        self.instance = next(_INSTANCES)
        """This construction's number, the same on every rank: each rank starts its constructions
        in the same order, and one refused part way on one rank only is refused on all (Note
        [agreed construction]), so the numbers stay in step (the built engine's ``save_instance``)."""
        self.removers: list[Callable[[], None]] = []
        """What undoes each hook on the model, in the order attached."""
        self.files_closers: list[Callable[[], None]] = []
        """Closers of the swap files (a rebuild, an undone construction)."""
        self.mesh: Optional["MeshInfo"] = None
        """The groups the construction uses, once known (the agreement's: Note [agreed construction])."""
        self.collectives_done = False
        """The construction's own collectives are behind (Note [agreed construction])."""
        self.teardown: Optional["Teardown"] = None
        """Once the hooks are all attached: what removes them (and more) in one go."""

    def close_files(self) -> None:
        for closer in self.files_closers:
            closer()


def abandon(attached: ConstructionRecord, exc: BaseException) -> None:
    """Undoes a construction that raised ``exc`` from what it had attached: hooks, forward
    wrappers and the module guard removed, swap files closed, the model's parameters put back.
    What fails on the way is added to ``exc`` as a note (the caller re-raises ``exc``)."""
    problems: list[str] = []

    def attempt(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # (the refusal is what the user needs to see: it is re-raised)
            problems.append(f"{type(e).__name__}: {e}")

    if attached.teardown is not None:
        attempt(attached.teardown)
    else:
        for remove in attached.removers:
            attempt(remove)
    attempt(attached.close_files)
    attempt(attached.snapshot.restore)
    for p in problems:
        exc.add_note(f"zeroshard: while putting the model back after this error: {p}")


# -- frozen weights under mixed precision ---------------------------------------------------------
def frozen_casts(params: Iterable[torch.Tensor], dtype: torch.dtype, trained: frozenset[int]
                 ) -> dict[int, torch.dtype]:
    """id -> dtype of the untrained floating-point parameters (not in ``trained``) mixed
    precision casts to ``dtype`` (they compute in the model dtype too)."""
    return {id(p): dtype for p in params
            if id(p) not in trained and p.is_floating_point() and p.dtype != dtype}


def as_planned(groups: list[dict], casts: dict[int, torch.dtype]) -> list[dict]:
    """``groups`` as the placement planner must see them: each frozen parameter still to be cast
    is shown in its new dtype, over its current storage (the memory the process holds for it
    now; the values are not read)."""
    def shown(p: torch.Tensor) -> torch.Tensor:
        dtype = casts.get(id(p))
        if dtype is None:
            return p
        need = p.numel() * torch.empty((), dtype=dtype).element_size()
        storage = local_of(p).untyped_storage()
        if p.is_meta or storage.nbytes() < need:  # (an upcast: counted at its new size, no storage)
            return torch.empty(p.shape, dtype=dtype, device="meta")
        contiguous = torch.empty(p.shape, device="meta").stride()  # (what set_ gives when not told)
        return torch.empty(0, dtype=dtype, device=p.device).set_(storage, 0, p.shape, contiguous)
    return [{**g, "params": [shown(p) for p in g["params"]]} for g in groups]


def cast_frozen(params: Iterable[torch.Tensor], casts: dict[int, torch.dtype]) -> None:
    """The last change of a construction: frozen weights outside any unit, and stage 3's
    zero-element parameters (in no unit either), take the model dtype (those in stage-3 units
    already hold it there)."""
    with torch.no_grad():
        for p in params:
            dtype = casts.get(id(p))
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
