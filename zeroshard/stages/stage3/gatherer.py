"""Gathering stage-3 units just before use and releasing them right after.

Lifecycle of a unit in one iteration (``UnitState``):

    RELEASED --gather--> GATHERING --wait--> GATHERED --release--> RELEASED

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

At most ``max_live`` non-root units are gathered or gathering at once; prefetch never
exceeds it.

Note [prefetch depth]: forward prefetches the next ``max_live - 1`` groups of the previous
forward's order, backward the next ``max_live - 1`` groups it reaches, each as far as the
bound allows: with the default of 2 that is the next group (the unit in use plus one read in
flight); a larger ``max_live_units`` lets the reads of units k+1, k+2, ... overlap the compute
of unit k, so a disk slower than one unit's compute per read still keeps up on average (the
gathered buffers of those units are the memory it costs: ``max_live_units`` x the largest
unit, which the planner counts). ``offload="auto"`` with ``max_live_units`` unset takes 3 when
the state it places leaves room for one more group (a deeper read-ahead, before the parameter
cache: a cached shard saves a read, a deeper prefetch only hides one; on this project's 2-core
VM disk a sweep of 2-6 live groups on a 16-block LoRA base changed nothing beyond noise, so the
budget's memory goes to state first). Every rank makes the same gather calls in the same order
(same model, same graph), which the collectives require. See Note [released parameters].

Note [compiled stage 3]: under ``torch.compile`` the hooks that gather and release units run
eagerly (``torch.compiler.disable``): resizing storage and issuing collectives are not
traceable, and a graph break at each unit boundary leaves every module's own computation
compiled. Dynamo does not guard on module hooks by default (``skip_nnmodule_hook_guards``), so
code it compiled for another, hook-free instance of the same model class may be reused; it
then reads the registered parameters, which between uses are sharded ones (Note [sharded
parameters]) and fail its tensor guards, so dynamo compiles anew rather than run the blocks
on released storage.

Note [sharded parameters]: outside the forward and backward of its unit a parameter is
registered in its module as a ``ShardedTensor`` Parameter over the owned piece of the unit's
shard (the scheme of FSDP2's sharded DTensor parameters), so torch code that reads it, prints
it, calls ``model.state_dict()`` / ``torch.save`` / ``load_state_dict`` or ``model.to()`` sees
real memory and global values (zeroshard/stages/sharded_tensor.py), and the optimizer's param
groups and ``.grad`` are those objects. While a unit is gathered its modules hold the
*unsharded* parameters instead: views into the gathered flat buffer that autograd saves and
accumulates into (the reducer's hooks are on them). The swap is of registrations only
(``module._parameters``), at gather and release; tied parameters are swapped in every module
that registers them. Code compiled for another instance of the model class cannot run the
blocks on released storage: a sharded parameter fails the compiled code's tensor guards.

Note [released parameters]: a unit's flat buffer keeps its storage *object* for its whole
life and every parameter stays a view into it; releasing resizes the storage to 0 bytes and
gathering resizes it back and refills it (the scheme of FSDP2). Tensors autograd saved in
forward (a weight, or a view like ``weight.t()``) therefore see the re-gathered data when
the output hook has run, and hold no memory in between. Using a released parameter (e.g. a
weight used outside the module that owns it) fails with "data is not allocated"; the root
forward wrapper adds which units were released.

Note [abandoned backward]: a backward that raised (an exception in a hook, Ctrl-C) never runs
the end-of-backward callback it queued, which releases every unit. Its flag left set, the
next backward would queue none either, so the root unit would stay gathered across the step
and the next forward would run on its old values. A forward (outside backward) that finds the
flag set settles first: every unit released, to be gathered again from the current shards.
Ctrl-C can also land as a gradient hook starts, leaving that gradient on the gathered
parameter the hook never took; autograd would add the next backward's gradient to it. The
reducer's ``finalize`` (run by ``zero_grad``, ``step`` and clipping) takes such gradients into
the abandoned pass's buckets first (``GradientReducer._take_untaken``).

Note [saving between steps]: a forward that raised, a ``loss = model(x)`` not yet followed by
backward, or Ctrl-C anywhere in an iteration leaves units gathered (the root one always, while
gradients are enabled) and their modules holding the unsharded parameters. A gathered buffer is
a copy of the shards, which only the step writes, so ``settle`` (run by ``save_checkpoint``)
releases every unit and the save records the committed shards: the state as if the unfinished
forward never ran. A graph kept from before still works: its output hooks gather the units
again in backward.
"""
from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from zeroshard.comm import Comm, Work
from zeroshard.io.buffers import held_bytes
from zeroshard.units.flat_unit import FlatUnit, alloc_storage, free_storage, is_allocated
from zeroshard.comm.tensor_parallel import as_sharded_parameter, local_of
from zeroshard.stages.sharded_tensor import ShardedTensor
from zeroshard.stages.stage3.forward_check import ForwardAgreement
from zeroshard.stages.stage3.gather_alias import can_lend, lend, take_back

if TYPE_CHECKING:
    from zeroshard.stages.stage3.secondary import SecondaryPartition


class Stage3UsageError(RuntimeError):
    """A model does something stage 3 cannot support (the message says what and why)."""


class UnitState(enum.Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParameterGatherer:
    def __init__(self, units: Sequence[FlatUnit], modules: Sequence[Optional[nn.Module]],
                 model: nn.Module, comm: Comm, max_live: int) -> None:
        if max_live < 1:
            raise ValueError(f"max_live_units={max_live} must be >= 1")
        self.units = list(units)
        self.modules = list(modules)
        self.model = model
        self.comm = comm
        self.max_live = max_live
        # Units of one module (its trainable and frozen units: Note [frozen units] in frozen.py)
        # are gathered and released together: a *group*. Group order follows the modules.
        by_module: dict[int, int] = {}
        self.groups: list[list[int]] = []
        self.group_modules: list[Optional[nn.Module]] = []
        for ui, m in enumerate(modules):
            key = id(m)
            if key not in by_module:
                by_module[key] = len(self.groups)
                self.groups.append([])
                self.group_modules.append(m)
            self.groups[by_module[key]].append(ui)
        self.group_of = {ui: gi for gi, g in enumerate(self.groups) for ui in g}
        self.root_group = by_module.get(id(None))
        self.roots = set(self.groups[self.root_group]) if self.root_group is not None else set()
        self.root = next((i for i in sorted(self.roots) if not self.units[i].frozen), None)
        """The trainable root unit (None without one)."""
        self.state = [UnitState.RELEASED] * len(units)
        self._work: list[Optional[Work]] = [None] * len(units)
        self._lent: set[int] = set()
        """Units gathered now by their shard's memory lent to the flat buffer (Note [gather by alias])."""
        self._order: list[int] = []       # this forward's group order
        self._last_order: list[int] = []  # the previous one: what prefetch follows
        self._bw_ptr = -1
        self._bw_callback = False
        self._handles: list[Any] = []
        self._orig_forward: Optional[Callable[..., object]] = None
        self._forwarding = False
        self.sharded: dict[int, nn.Parameter] = {}
        """id(unsharded parameter) -> the sharded Parameter shown outside use (Note [sharded parameters])."""
        self._regs: list[list[tuple[nn.Module, str, nn.Parameter]]] = [[] for _ in self.units]
        self.secondary: Optional[SecondaryPartition] = None
        """hpZ's SecondaryPartition (zeroshard/stages/stage3/secondary.py), which gathers units then."""
        self.forward_check = ForwardAgreement(comm)
        """An evaluation's first forward agrees with the other ranks first (Note [forward on every rank])."""
        self._evaluating = False
        self.keep_sharded = False
        """``remove`` leaves the sharded parameters registered (the optimizer was collected at
        world size > 1: ownership.hand_back_collected)."""
        self._make_sharded()

    # -- sharded parameters (Note [sharded parameters]) -------------------------------------------
    def _make_sharded(self) -> None:
        comm = self.comm if self.comm.world_size > 1 else None
        where: dict[int, int] = {}
        for ui, unit in enumerate(self.units):
            lo, hi = unit.owned
            for m, seg in zip(unit.members, unit.layout.segments):
                a, b = max(lo, seg.offset), min(hi, seg.end)
                t = ShardedTensor(unit.shard, a - lo if a < b else 0, max(0, b - a), seg.shape, unit.dtype,
                                  m.param.device, max(0, a - seg.offset), comm, unit, part="shard")
                sp = as_sharded_parameter(m.param, t)  # (a DTensor's: Note [tensor-parallel parameters])
                shown = local_of(sp)  # (a Parameter over a ShardedTensor is one, made by its detach)
                if not isinstance(shown, ShardedTensor):
                    raise RuntimeError(f"the sharded parameter of {seg.name} is a {type(shown).__name__}, "
                                       "not a ShardedTensor")
                shown.on_use = functools.partial(self._check_use, seg.name)
                self.sharded[id(m.param)] = sp
                where[id(m.param)] = ui
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in where:
                    self._regs[where[id(p)]].append((module, name, p))
        self._seen_requires_grad: dict[int, bool] = {}
        for ui in range(len(self.units)):
            self.show(ui, sharded=True)

    def show(self, ui: int, sharded: bool) -> None:
        for module, name, p in self._regs[ui]:
            shown = self.sharded[id(p)]
            # (frozen or unfrozen between steps by torch code on the sharded parameter it sees:
            # the gathered one follows; a change made on the gathered object itself stays)
            if not sharded and shown.requires_grad != self._seen_requires_grad.get(id(p), shown.requires_grad):
                p.requires_grad_(shown.requires_grad)
            self._seen_requires_grad[id(p)] = shown.requires_grad
            module._parameters[name] = shown if sharded else p

    def visible(self, p: torch.Tensor) -> torch.Tensor:
        """What torch code sees of managed parameter ``p`` between uses."""
        return self.sharded.get(id(p), p)

    def _check_use(self, name: str, func: Any) -> None:
        if self._forwarding or _in_backward():
            raise Stage3UsageError(
                f"{name} was used by {func} while its unit was released: a parameter used outside the "
                "module that owns it is not gathered there. Make the module that uses it part of a "
                "larger unit (stage3_unit_classes=[...]) or let it stay in the root unit.")

    # -- registration ------------------------------------------------------------------------
    def register(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(self.model.register_forward_hook(self._root_post_forward))
        for gi, module in enumerate(self.group_modules):
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, gi)))
                self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, gi)))
        self._orig_forward = orig = self.model.forward

        @functools.wraps(orig)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return self._guarded_forward(orig, args, kwargs)
        self.model.forward = guarded

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ui in range(len(self.units)):  # the model's own parameters are registered again
            self.show(ui, sharded=self.keep_sharded)
        if self._orig_forward is not None:
            del self.model.forward  # the instance attribute; the class method shows again
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
            released = [seg.name for i, u in enumerate(self.units) if self.state[i] is UnitState.RELEASED
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

    # -- gather / release ---------------------------------------------------------------------
    def _live(self) -> int:
        return len({self.group_of[i] for i, st in enumerate(self.state)
                    if st is not UnitState.RELEASED and i not in self.roots})

    def _start(self, ui: int) -> None:
        unit = self.units[ui]
        if unit.needs_init:
            raise Stage3UsageError(
                f"unit {ui} ({unit.layout.segments[0].name}, ...) has no values yet: the model was "
                "built on the meta device. Load weights with zeroshard.load_safetensors(model, path) "
                "or initialise them with zeroshard.init_meta_weights(model) before the first forward.")
        unit.await_step(whole=self._waits_whole_step(unit))  # (Note [overlapped step])
        if self.secondary is None and can_lend(unit, self.comm.world_size):  # Note [gather by alias]
            lend(unit.flat, unit.shard)
            self._lent.add(ui)
            self.state[ui] = UnitState.GATHERING
            self._work[ui] = self.comm.gather_shards(unit.flat)  # (one rank: nothing to wait for)
            return
        alloc_storage(unit.flat)
        self.state[ui] = UnitState.GATHERING
        swap = unit.swap_holding("shard")
        if swap is not None:  # the shard streams in from the swap file first; the
            lo, hi = unit.owned  # collective starts once it is here (_launch)
            if self.secondary is None:
                swap.fetch_for_gather(unit, unit.flat[lo:hi], backward=_in_backward())
            else:
                swap.fetch(unit, ("shard",))
            return
        self._launch(ui)

    def _launch(self, ui: int) -> Work:
        """Starts unit ``ui``'s collective (``_work[ui]``), and returns it."""
        if self.secondary is not None:  # hpZ: inside the node (Note [hpZ secondary partition])
            work = self._work[ui] = self.secondary.gather(ui)
            return work
        unit = self.units[ui]
        lo, hi = unit.owned
        swap = unit.swap_holding("shard")
        if swap is not None:  # (the shard is dropped unless the parameter cache keeps it)
            swap.finish_gather(unit, unit.flat[lo:hi], backward=_in_backward())
        else:
            unit.flat[lo:hi].copy_(unit.shard)
        work = self._work[ui] = self.comm.gather_shards(unit.flat)
        return work

    def _waits_whole_step(self, unit: FlatUnit) -> bool:
        """A unit the parameter cache keeps waits for the whole step in flight: the cache and
        the moments' pool share one memory in the plan (Note [overlapped step])."""
        cache = getattr(unit.swap, "cache", None) if unit.swap is not None else None
        return cache is not None and cache.keep(unit, _in_backward())

    def forward_unit_order(self) -> list[int]:
        """Unit indices in the order forward gathers them (the root group first, then the last
        forward's order), then any unit it did not gather: the order an overlapped step takes."""
        seq = ([self.root_group] if self.root_group is not None else []) + list(self._order or self._last_order)
        out = list(dict.fromkeys(ui for gi in seq for ui in self.groups[gi]))
        seen = set(out)
        return out + [i for i in range(len(self.units)) if i not in seen]

    def prefetch(self, ui: int) -> None:
        unit = self.units[ui]
        if unit.step_pending(whole=self._waits_whole_step(unit)):
            return  # (a prefetch never waits for the step: the gather itself will)
        live = self.state[ui] is not UnitState.RELEASED or any(
            self.state[i] is not UnitState.RELEASED for i in self.groups[self.group_of[ui]])
        if self.state[ui] is UnitState.RELEASED and (ui in self.roots or live or self._live() < self.max_live):
            self._start(ui)

    def prefetch_group(self, gi: int) -> None:
        for ui in self.groups[gi]:
            self.prefetch(ui)

    def ensure_group(self, gi: int) -> None:
        for ui in self.groups[gi]:  # every read or collective starts before the first wait
            if self.state[ui] is UnitState.RELEASED:
                self._start(ui)
        for ui in self.groups[gi]:
            self.ensure(ui)

    def ensure(self, ui: int) -> None:
        if self.state[ui] is UnitState.RELEASED:
            self._start(ui)
        if self.state[ui] is UnitState.GATHERING:
            work = self._work[ui]
            if work is None:
                work = self._launch(ui)
            self.forward_check.wait(work, self.model)  # (bounded: Note [bounded divergence])
            self._work[ui] = None
            self.state[ui] = UnitState.GATHERED
            self.show(ui, sharded=False)

    def release(self, ui: int) -> None:
        if self.state[ui] is UnitState.RELEASED:
            return
        unit = self.units[ui]
        if self.state[ui] is UnitState.GATHERING:  # the collective must complete on every rank
            work, swap = self._work[ui], unit.swap_holding("shard")
            if work is not None:
                self.forward_check.wait(work, self.model)
            elif swap is not None:  # never launched (the same on every rank): drop the read
                swap.evict(unit, ("shard",))
            self._work[ui] = None
        if ui in self._lent:  # (the shard's memory: never to the host pool)
            self._lent.discard(ui)
            take_back(unit.flat)
        else:
            free_storage(unit.flat)
        self.state[ui] = UnitState.RELEASED
        self.show(ui, sharded=True)

    def release_all(self) -> None:
        for ui in range(len(self.units)):
            self.release(ui)

    def release_group(self, gi: int) -> None:
        for ui in self.groups[gi]:
            self.release(ui)

    def settle(self) -> None:
        """Every unit released and what a forward or backward that never finished (an exception,
        Ctrl-C) left behind dropped, so torch code sees the sharded parameters over the committed
        shards: a save between steps records exactly those (Note [saving between steps])."""
        if _in_backward():
            raise RuntimeError("a checkpoint cannot be saved from inside backward (a gradient hook): "
                               "save after backward returns, or after catching the KeyboardInterrupt")
        self.release_all()
        for ui, unit in enumerate(self.units):  # (interrupted between allocating and gathering)
            if self.state[ui] is UnitState.RELEASED and is_allocated(unit.flat):
                free_storage(unit.flat)
            self.show(ui, sharded=True)
        self._bw_callback = False

    def gathered_bytes(self) -> int:
        return sum(held_bytes(u.flat) for u in self.units)

    # -- forward hooks --------------------------------------------------------------------------
    @torch.compiler.disable  # Note [compiled stage 3]
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            if self._bw_callback:  # the last backward never ended (Note [abandoned backward])
                self.settle()
            evaluating = not torch.is_grad_enabled() or not self.model.training
            if evaluating and not self._evaluating:  # an evaluation starts: on every rank? (Note [forward on every rank])
                self.forward_check.check(self.model)
            self._evaluating = evaluating
            if self._order:
                self._last_order = self._order
            self._order = []
        if self.root_group is not None:
            self.ensure_group(self.root_group)
        if self._last_order and not _in_backward():
            self.prefetch_group(self._last_order[0])

    @torch.compiler.disable  # Note [compiled stage 3]
    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.root_group is None or _in_backward():
            return output
        self._check_shapes(self.root_group)
        if torch.is_grad_enabled():
            return self._wrap(self.root_group, output)
        self.release_group(self.root_group)
        return output

    @torch.compiler.disable  # Note [compiled stage 3]
    def _pre_forward(self, gi: int, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            self._order.append(gi)
            pos = len(self._order)
            self.ensure_group(gi)
            for ahead in self._last_order[pos:pos + self.max_live - 1]:  # (Note [prefetch depth])
                self.prefetch_group(ahead)
        else:
            self.ensure_group(gi)

    @torch.compiler.disable  # Note [compiled stage 3]
    def _post_forward(self, gi: int, module: nn.Module, args: Any, output: Any) -> Any:
        self._check_shapes(gi)
        if _in_backward():  # activation recomputation: the recomputed graph needs the unit
            return output
        output = self._returned_parameters(gi, output)
        if torch.is_grad_enabled():
            output = self._wrap(gi, output)
        self.release_group(gi)
        return output

    def _returned_parameters(self, gi: int, output: object) -> object:
        """A module that returns its own parameter (``return out, self.bias``, as Megatron-style
        layers do) or a view of one hands its caller memory the release below frees, and the
        caller's reads would touch freed memory (a SIGSEGV, no Python error). Such outputs are
        given as copies (``clone``: autograd carries their gradient to the parameter as before)."""
        storages = {self.units[ui].flat.untyped_storage().data_ptr() for ui in self.groups[gi]}
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
        for ui in self.groups[gi]:
            self._check_unit_shapes(ui)

    def _check_unit_shapes(self, ui: int) -> None:
        unit = self.units[ui]
        if self.state[ui] is not UnitState.GATHERED:
            return
        for m, seg in zip(unit.members, unit.layout.segments):
            laid_out = local_of(m.param)  # (a DTensor's local shard)
            if laid_out.shape != seg.shape or laid_out.data_ptr() != unit.flat[seg.offset:].data_ptr():
                raise Stage3UsageError(
                    f"parameter {seg.name!r} changed shape from {tuple(seg.shape)} to "
                    f"{tuple(laid_out.shape)} (or was replaced) during forward; stage 3 partitions "
                    "parameters by their shape at construction, so modules must not resize or replace them")

    # -- backward -------------------------------------------------------------------------------
    def before_backward(self, gi: int) -> None:
        if not self._bw_callback:
            self._bw_callback = True
            self._bw_ptr = len(self._order) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        p = self._bw_ptr
        while p >= 0 and self._order[p] != gi:
            p -= 1
        if p >= 0:  # backward is done with the groups after this one: frozen units go now
            self._release_frozen_after(p, gi)
        self.ensure_group(gi)
        if p >= 0:
            self._bw_ptr = p - 1
            for q in range(p - 1, max(-1, p - self.max_live), -1):  # (Note [prefetch depth])
                self.prefetch_group(self._order[q])

    def _release_frozen_after(self, p: int, gi: int) -> None:
        """Frozen units of the groups that ran after position ``p`` in forward: no backward node
        left reads them (Note [frozen units] in zeroshard/stages/stage3/frozen.py)."""
        for later in set(self._order[p + 1:]) - {gi, self.root_group}:
            for ui in self.groups[later]:
                if self.units[ui].frozen and self.state[ui] is UnitState.GATHERED:
                    self.release(ui)

    def on_unit_reduced(self, ui: int) -> None:
        """The unit's gradients are all accumulated and sent: nothing in backward reads it."""
        if ui not in self.roots and _in_backward():
            self.release(ui)

    def _end_backward(self) -> None:
        self._bw_callback = False
        self.release_all()
