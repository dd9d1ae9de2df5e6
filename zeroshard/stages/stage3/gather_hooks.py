"""The module hooks that drive stage 3's gathers: when each unit is gathered and released in
one iteration (the gathering itself: zeroshard/stages/stage3/gatherer.py).

- forward: a pre-hook on the unit's module gathers it (waiting for a prefetch if one is in
  flight) and prefetches the next unit of the previous iteration's forward order; a post-hook
  releases it (the root unit, which holds what is used around the blocks, stays gathered
  while gradients are enabled) and hooks the module's outputs;
- backward: the first output hook runs before the module's own backward and gathers the unit
  again, prefetching the unit that backward reaches next; the unit is released as soon as
  its gradients are sent for reduction (every parameter's gradient is then accumulated, so
  no remaining backward node reads it); an end-of-backward callback releases the rest;
- activation checkpointing re-runs a forward inside backward: the unit is gathered then,
  and the post-hook does not release it (the recomputed graph still needs it).

Lifecycle: built with its gatherer; ``register`` puts the hooks (and a wrapper of the root
forward) on the model, ``remove`` takes them off. Between the two it keeps the iteration's
group order, which the next forward's prefetch follows.

Note [compiled stage 3]: under ``torch.compile`` the hooks that gather and release units run
eagerly (``torch.compiler.disable``): resizing storage and issuing collectives are not
traceable, and a graph break at each unit boundary leaves every module's own computation
compiled. Dynamo does not guard on module hooks by default (``skip_nnmodule_hook_guards``), so
code it compiled for another, hook-free instance of the same model class may be reused; it
then reads the registered parameters, which between uses are sharded ones (Note [sharded
parameters]) and fail its tensor guards, so dynamo compiles anew rather than run the blocks
on released storage.

Note [abandoned backward]: a backward that raised (an exception in a hook, Ctrl-C) never runs
the end-of-backward callback it queued, which releases every unit. Its flag left set, the
next backward would queue none either, so the root unit would stay gathered across the step
and the next forward would run on its old values. A forward (outside backward) that finds the
flag set settles first: every unit released, to be gathered again from the current shards.
Ctrl-C can also land as a gradient hook starts, leaving that gradient on the gathered
parameter the hook never took; autograd would add the next backward's gradient to it. The
reducer's ``finalize`` (run by ``zero_grad``, ``step`` and clipping) takes such gradients into
the abandoned pass's buckets first (``GradientReducer._take_untaken``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from zeroshard.comm.tensor_parallel import local_of
from zeroshard.stages.stage3.forward_check import ForwardAgreement
from zeroshard.stages.stage3.unit_state import UnitState
from zeroshard.units.flat_unit import FlatUnit


class Stage3UsageError(RuntimeError):
    """A model does something stage 3 cannot support (the message says what and why)."""


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Gathering(Protocol):
    """What the hooks drive: the gatherer's groups of units and its gather / release."""
    units: list[FlatUnit]
    groups: list[list[int]]
    group_modules: list[Optional[nn.Module]]
    root_group: Optional[int]
    max_live: int
    model: nn.Module
    forward_check: ForwardAgreement

    @property
    def state(self) -> Sequence[UnitState]: ...

    def ensure_group(self, gi: int) -> None: ...

    def prefetch_group(self, gi: int) -> None: ...

    def release(self, ui: int) -> None: ...

    def release_group(self, gi: int) -> None: ...

    def release_all(self) -> None: ...

    def settle(self) -> None: ...


_EAGER_UNDER_COMPILE = ("_root_pre_forward", "_root_post_forward", "_pre_forward", "_post_forward")


def _run_eagerly_under_compile() -> None:
    """Marks the forward hooks ``torch.compiler.disable`` (Note [compiled stage 3]) the first time
    hooks are built, not when this file is imported: ``torch.compiler.disable`` imports
    torch._dynamo, 0.6 s of CPU that a process never building stage 3 should not pay (Note
    [pipelining imported on first use] in comm/pipeline.py). Hooks are built before any forward,
    so a compiled forward only ever sees the disabled methods."""
    if GatherHooks.__dict__.get("_eager_marked"):
        return
    for name in _EAGER_UNDER_COMPILE:
        setattr(GatherHooks, name, torch.compiler.disable(GatherHooks.__dict__[name]))
    GatherHooks._eager_marked = True


class GatherHooks:
    _eager_marked = False

    def __init__(self, gathering: Gathering) -> None:
        _run_eagerly_under_compile()
        self.g = gathering
        self.order: list[int] = []       # this forward's group order
        self.last_order: list[int] = []  # the previous one: what prefetch follows
        self._bw_ptr = -1
        self.backward_queued = False
        """The end-of-backward callback is queued (Note [abandoned backward])."""
        self._handles: list[Any] = []
        self._orig_forward: Optional[Callable[..., object]] = None
        self._forwarding = False
        self._evaluating = False

    # -- registration ------------------------------------------------------------------------
    def register(self) -> None:
        model = self.g.model
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(model.register_forward_hook(self._root_post_forward))
        for gi, module in enumerate(self.g.group_modules):
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, gi)))
                self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, gi)))
        self._orig_forward = orig = model.forward

        @functools.wraps(orig)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return self._guarded_forward(orig, args, kwargs)
        model.forward = guarded

    def remove(self) -> None:
        """The hooks off (the gatherer registers the model's own parameters again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._orig_forward is not None:
            del self.g.model.forward  # the instance attribute; the class method shows again
            self._orig_forward = None

    def _guarded_forward(self, forward: Any, args: tuple, kwargs: dict) -> Any:
        outer = self._forwarding
        self._forwarding = True
        try:
            return forward(*args, **kwargs)
        except (Stage3UsageError, torch._dynamo.exc.TorchDynamoException):
            raise
        except RuntimeError as exc:
            # (the user's exception, of its own type, e.g. torch.OutOfMemoryError: the diagnosis
            # is a note, and only where torch refused a tensor whose storage was released)
            released = [seg.name for i, u in enumerate(self.g.units) if self.g.state[i] is UnitState.RELEASED
                        for seg in u.layout.segments]
            if released and "storage of size 0" in str(exc):
                exc.add_note(
                    f"zeroshard stage 3: when this failed, the parameters of {len(released)} "
                    f"partitioned tensors were released (e.g. {released[:4]}). A parameter used outside "
                    "the module that owns it is not gathered there: make the module that uses it part "
                    "of a larger unit (stage3_unit_classes=[...]) or let it stay in the root unit.")
            raise
        finally:
            self._forwarding = outer

    def check_use(self, name: str, func: Any) -> None:
        """A sharded parameter was read (``ShardedTensor.on_use``): inside a forward or backward
        that means the module that owns it did not gather it."""
        if self._forwarding or in_backward():
            raise Stage3UsageError(
                f"{name} was used by {func} while its unit was released: a parameter used outside the "
                "module that owns it is not gathered there. Make the module that uses it part of a "
                "larger unit (stage3_unit_classes=[...]) or let it stay in the root unit.")

    # -- forward hooks --------------------------------------------------------------------------
    # (run eagerly under torch.compile: _EAGER_UNDER_COMPILE, Note [compiled stage 3])
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        g = self.g
        if not in_backward():
            if self.backward_queued:  # the last backward never ended (Note [abandoned backward])
                g.settle()
            evaluating = not torch.is_grad_enabled() or not g.model.training
            if evaluating and not self._evaluating:  # an evaluation starts: on every rank? (Note [forward on every rank])
                g.forward_check.check(g.model)
            self._evaluating = evaluating
            if self.order:
                self.last_order = self.order
            self.order = []
        if g.root_group is not None:
            g.ensure_group(g.root_group)
        if self.last_order and not in_backward():
            g.prefetch_group(self.last_order[0])

    # (run eagerly under torch.compile: _EAGER_UNDER_COMPILE, Note [compiled stage 3])
    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        root = self.g.root_group
        if root is None or in_backward():
            return output
        self._check_shapes(root)
        if torch.is_grad_enabled():
            return self._wrap(root, output)
        self.g.release_group(root)
        return output

    # (run eagerly under torch.compile: _EAGER_UNDER_COMPILE, Note [compiled stage 3])
    def _pre_forward(self, gi: int, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self.order.append(gi)
            pos = len(self.order)
            self.g.ensure_group(gi)
            for ahead in self.last_order[pos:pos + self.g.max_live - 1]:  # (Note [prefetch depth])
                self.g.prefetch_group(ahead)
        else:
            self.g.ensure_group(gi)

    # (run eagerly under torch.compile: _EAGER_UNDER_COMPILE, Note [compiled stage 3])
    def _post_forward(self, gi: int, module: nn.Module, args: Any, output: Any) -> Any:
        self._check_shapes(gi)
        if in_backward():  # activation recomputation: the recomputed graph needs the unit
            return output
        output = self._returned_parameters(gi, output)
        if torch.is_grad_enabled():
            output = self._wrap(gi, output)
        self.g.release_group(gi)
        return output

    def _returned_parameters(self, gi: int, output: object) -> object:
        """A module that returns its own parameter (``return out, self.bias``, as Megatron-style
        layers do) or a view of one hands its caller memory the release below frees, and the
        caller's reads would touch freed memory (a SIGSEGV, no Python error). Such outputs are
        given as copies (``clone``: autograd carries their gradient to the parameter as before)."""
        storages = {self.g.units[ui].flat.untyped_storage().data_ptr() for ui in self.g.groups[gi]}
        storages.discard(0)

        def aliases(t: object) -> bool:
            return (isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and t.numel() > 0
                    and t.untyped_storage().data_ptr() in storages)
        if not any(aliases(t) for t in tree_flatten(output)[0]):  # (the usual case: nothing to copy)
            return output
        return tree_map(lambda t: t.clone() if aliases(t) else t, output)

    def _wrap(self, gi: int, output: Any) -> Any:
        """Gathers the group again before backward reaches the module: a hook on each output
        that carries gradient (the first to fire does it). The outputs stay the tensors the
        module returned, so callers may modify them in place (``loss /= k``)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [False]

        def before(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self.before_backward(gi)
        for t in tensors:
            t.register_hook(before)
        return output

    def _check_shapes(self, gi: int) -> None:
        for ui in self.g.groups[gi]:
            self._check_unit_shapes(ui)

    def _check_unit_shapes(self, ui: int) -> None:
        unit = self.g.units[ui]
        if self.g.state[ui] is not UnitState.GATHERED:
            return
        for m, seg in zip(unit.members, unit.layout.segments):
            laid_out = local_of(m.param)  # (a DTensor's local shard)
            if laid_out.shape != seg.param_shape or laid_out.data_ptr() != unit.flat[seg.offset:].data_ptr():
                raise Stage3UsageError(
                    f"parameter {seg.name!r} changed shape from {tuple(seg.param_shape)} to "
                    f"{tuple(laid_out.shape)} (or was replaced) during forward; stage 3 partitions "
                    "parameters by their shape at construction, so modules must not resize or replace them")

    # -- backward -------------------------------------------------------------------------------
    def before_backward(self, gi: int) -> None:
        if not self.backward_queued:
            self.backward_queued = True
            self._bw_ptr = len(self.order) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        p = self._bw_ptr
        while p >= 0 and self.order[p] != gi:
            p -= 1
        if p >= 0:  # backward is done with the groups after this one: frozen units go now
            self._release_frozen_after(p, gi)
        self.g.ensure_group(gi)
        if p >= 0:
            self._bw_ptr = p - 1
            for q in range(p - 1, max(-1, p - self.g.max_live), -1):  # (Note [prefetch depth])
                self.g.prefetch_group(self.order[q])

    def _release_frozen_after(self, p: int, gi: int) -> None:
        """Frozen units of the groups that ran after position ``p`` in forward: no backward node
        left reads them (Note [frozen units] in zeroshard/stages/stage3/frozen.py)."""
        for later in set(self.order[p + 1:]) - {gi, self.g.root_group}:
            for ui in self.g.groups[later]:
                if self.g.units[ui].frozen and self.g.state[ui] is UnitState.GATHERED:
                    self.g.release(ui)

    def _end_backward(self) -> None:
        self.backward_queued = False
        self.g.release_all()
