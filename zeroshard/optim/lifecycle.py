"""Which ZeroOptimizer owns a parameter, and taking one down again.

A ZeroOptimizer hooks its parameters (gradient hooks move every gradient into its buckets and
clear ``.grad``), so a second one over the same parameters would train on nothing while the
first is alive: that is refused, naming the parameters. Once the first is closed
(``close()``) or garbage collected, its hooks, stage-3 forward hooks and module guard are
removed and the parameters may be wrapped again. Nothing here holds the optimizer strongly:
the hooks reach it through weak references, so ``del opt`` really frees it.
"""
from __future__ import annotations

import contextlib
import gc
import signal
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from zeroshard.comm.tensor_parallel import is_dtensor
from zeroshard.io.host_pool import HOST_POOL

if TYPE_CHECKING:
    from zeroshard.stages.stage3.gatherer import ParameterGatherer
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.step_in_flight import StepInFlight

_OWNER = "_zeroshard_owner"  # attribute on each managed parameter: weakref to its optimizer


def live_owner(p: torch.Tensor) -> Optional[object]:
    ref = getattr(p, _OWNER, None)
    opt = ref() if ref is not None else None
    return opt if opt is not None and not getattr(opt, "closed", False) else None


def check_unclaimed(params: Sequence[torch.Tensor], names: dict[int, str]) -> None:
    """Refuses parameters another live ZeroOptimizer manages (after collecting garbage: an
    optimizer the user dropped may still sit in a reference cycle)."""
    if not any(live_owner(p) is not None for p in params):
        return
    gc.collect()
    taken = [p for p in params if live_owner(p) is not None]
    if taken:
        shown = ", ".join(repr(names.get(id(p), "?")) for p in taken[:3])
        more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
        raise RuntimeError(
            f"parameter(s) {shown}{more} already belong to a live ZeroOptimizer "
            f"({live_owner(taken[0])!r}), whose hooks take their gradients; a second one would train "
            "on zeros. Call close() on the first (or delete every reference to it) before building "
            "another, or use param groups in one optimizer for different settings")


def claim(params: Sequence[torch.Tensor], opt: object) -> None:
    ref = weakref.ref(opt)
    for p in params:
        setattr(p, _OWNER, ref)


def weak_method(method: Callable) -> Callable:
    """A callback that calls ``method`` while its object lives (and does nothing after)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return bound(*args, **kwargs) if bound is not None else None
    return call


class Teardown:
    """Removes what a ZeroOptimizer attached to the model; idempotent. Runs from ``close()``
    or once the optimizer is collected (so it must not reference it): then it first waits for
    a step in flight and, at stage 3, gives the parameters back (``hand_back``), before the
    swap files close (they run it first: ``before_close``)."""

    def __init__(self, removers: Sequence[Callable[[], None]], params: Sequence[torch.Tensor],
                 inflight: Optional["StepInFlight"] = None, hand_back: Optional[Callable[[], None]] = None) -> None:
        self._removers = list(removers)
        self._params = [weakref.ref(p) for p in params]
        self._inflight = inflight
        self._hand_back = hand_back
        self.done = False

    def __call__(self, handed_back: bool = False) -> None:
        if self.done:
            return
        self.done = True
        # (at interpreter exit nothing will use the model again: no reading it back from disk)
        exiting = not threading.main_thread().is_alive()
        if self._inflight is not None:
            try:
                self._inflight.join()
            except BaseException as exc:  # (a finalizer has no caller to raise to)
                warnings.warn(f"the optimizer step in flight when the ZeroOptimizer was collected failed: "
                              f"{type(exc).__name__}: {exc}; its parameters are partly updated", stacklevel=2)
        if self._hand_back is not None and not handed_back and not exiting:
            try:
                self._hand_back()
            except Exception as exc:
                warnings.warn(f"giving the stage-3 parameters back as the ZeroOptimizer was collected failed "
                              f"({type(exc).__name__}: {exc}); call opt.close() before dropping it", stacklevel=2)
        for remove in self._removers:
            remove()
        for ref in self._params:
            p = ref()
            if p is not None and hasattr(p, _OWNER):
                delattr(p, _OWNER)
        HOST_POOL.trim()  # (its buffers outlive steps, not the optimizer: Note [reused host buffers])


def hand_back_stage3(gatherer: "ParameterGatherer", units: Sequence["FlatUnit"]) -> None:
    """Stage 3 closing: every unit gathered once more and each parameter given its own full
    tensor, so the model works without the optimizer (a collective: all ranks call it)."""
    for ui in range(len(units)):
        gatherer.ensure(ui)
    with torch.no_grad():
        for unit in units:
            for m, seg in zip(unit.members, unit.layout.segments):
                own = unit.flat[seg.offset:seg.end].view(seg.shape).clone()
                if is_dtensor(m.param):  # (its local shard: Note [tensor-parallel parameters])
                    m.param._local_tensor = own
                else:
                    m.param.data = own
    gatherer.release_all()


def hand_back_collected(gatherer: "ParameterGatherer", units: Sequence["FlatUnit"], world_size: int) -> None:
    """Stage 3, the optimizer collected without ``close()``: no collective can run from a
    finalizer (other ranks collect theirs at other times). One rank holds everything, so it
    gets its full parameters as ``close()`` gives them; with more, every parameter stays the
    sharded one torch code saw between uses (Note [sharded parameters]), with its shard in
    memory, so reads, ``state_dict()``, ``zeroshard.full_state_dict`` and SPMD ops stay correct."""
    if world_size == 1:
        hand_back_stage3(gatherer, units)
        return
    gatherer.settle()
    for unit in units:
        store = getattr(unit, "swap", None)
        if store is not None and store.swaps(unit, "shard"):
            store.load(unit, ("shard",))
        unit.swap = None  # (its files close with the optimizer)
    gatherer.keep_sharded = True


def take_back_collected(module: nn.Module) -> None:
    """A new optimizer over a model whose stage-3 optimizer was collected at world > 1
    (``hand_back_collected`` left its parameters the sharded ones): each gets its full values
    back as an ordinary parameter first, tied ones once (a collective, as every construction
    is: all ranks build the optimizer, in the same module order). DeepSpeed's tests build a
    fresh engine on the same model and load a checkpoint into it."""
    from zeroshard.stages.sharded_tensor import ShardedTensor
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if not isinstance(p, ShardedTensor) or p.unit is None or any(
                        live_owner(m.param) is not None for m in p.unit.members):
                    continue  # (a live optimizer's: the construction refuses it, naming it)
                if id(p) not in full:
                    full[id(p)] = nn.Parameter(p.full().clone(), requires_grad=p.requires_grad)
                sub._parameters[name] = full[id(p)]


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block takes effect as it ends, so an update is applied to every
    unit or to none (Note [saving between steps] in stages/stage3/gatherer.py); a second Ctrl-C
    goes through at once (a hung collective can still be interrupted). Only where Python
    handles SIGINT: the main thread, with a Python-level handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or a handler set outside Python
        yield
        return
    held: list[Any] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(frame)
        if len(held) > 1:
            signal.signal(signal.SIGINT, previous)
            previous(signum, frame)
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, previous)
        if len(held) == 1:
            previous(signal.SIGINT, held[0])


def state_restored(opt: object, step: Optional[int] = None) -> None:
    """The optimizer's whole state was loaded (a checkpoint, a state dict): a failed step's
    refusal ends (Note [failed steps]), and a checkpoint's step becomes ``steps_done``. (Any
    torch.optim optimizer loads a checkpoint; only a ZeroOptimizer's engine counts steps.)"""
    engine = getattr(opt, "engine", None)
    if engine is not None:
        engine.inflight.restored()
        if step is not None:
            engine.inflight.steps = int(step)


def groups_with(visible: Callable[[torch.Tensor], torch.Tensor], units: Sequence["FlatUnit"],
                param_groups: list[dict], param_group: dict) -> list[dict]:
    """The param groups a rebuild for ``add_param_group`` builds from (Note [rebuild on
    add_param_group] in zero_optimizer.py): the current ones plus ``param_group``, each naming
    the model's own parameters (stage 3 shows torch code other objects between uses)."""
    shown = {id(visible(m.param)): (visible(m.param), m.param) for u in units for m in u.members}
    own = {i: orig for i, (_, orig) in shown.items()}
    for seen, orig in shown.values():  # (stage 3: a frozen weight unfrozen through either object torch
        if seen is not orig and seen.requires_grad != orig.requires_grad:  # code may hold)
            orig.requires_grad_(True)
    groups = [{**{k: v for k, v in g.items() if k != "adamw_mode"},  # (the kernel's key, derived again)
               "params": [own.get(id(p), p) for p in g["params"]]} for g in param_groups]
    new = dict(param_group)
    new["params"] = [new["params"]] if isinstance(new["params"], torch.Tensor) else list(new["params"])
    new["params"] = [own.get(id(p), p) for p in new["params"]]
    taken = {id(p) for g in groups for p in g["params"]}
    twice = [i for i, p in enumerate(new["params"]) if id(p) in taken]
    if twice:
        raise ValueError(f"some parameters appear in more than one parameter group (positions {twice[:5]} "
                         "of the new group are in an existing one)")
    return groups + [new]
