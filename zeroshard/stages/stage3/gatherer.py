"""Gathering stage-3 units just before use and releasing them right after.

Lifecycle: built by ``Sharding.start`` (zeroshard/stages/sharding.py) once every unit is, when it
registers every managed parameter's sharded form in its modules; ``register`` puts the module
hooks on (zeroshard/stages/stage3/gather_hooks.py: *when* each unit is gathered and released),
``remove`` takes them off and registers the model's own parameters again. Between the two it
gathers and releases units on demand, each unit's step recorded by its ``UnitState``
(zeroshard/stages/stage3/unit_state.py). At most ``max_live`` non-root units are gathered or
gathering at once; prefetch never exceeds it.

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

Note [saving between steps]: a forward that raised, a ``loss = model(x)`` not yet followed by
backward, or Ctrl-C anywhere in an iteration leaves units gathered (the root one always, while
gradients are enabled) and their modules holding the unsharded parameters. A gathered buffer is
a copy of the shards, which only the step writes, so ``settle`` (run by ``save_checkpoint``)
releases every unit and the save records the committed shards: the state as if the unfinished
forward never ran. A graph kept from before still works: its output hooks gather the units
again in backward.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from zeroshard.comm import Comm
from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.io.buffers import held_bytes
from zeroshard.units.flat_unit import FlatUnit, alloc_storage, free_storage, is_allocated
from zeroshard.comm.tensor_parallel import as_sharded_parameter, local_of
from zeroshard.stages.sharded_tensor import ShardedTensor
from zeroshard.stages.stage3.forward_check import ForwardAgreement
from zeroshard.stages.stage3.gather_alias import can_lend, lend, take_back
from zeroshard.stages.stage3.gather_hooks import GatherHooks, Stage3UsageError, in_backward
from zeroshard.stages.stage3.unit_state import UnitState, UnitStates

if TYPE_CHECKING:
    from zeroshard.stages.stage3.secondary import SecondaryPartition

__all__ = ["ParameterGatherer", "Stage3UsageError", "UnitState"]


class ParameterGatherer:
    def __init__(self, units: Sequence[FlatUnit], modules: Sequence[Optional[nn.Module]],
                 model: nn.Module, comm: Comm, max_live: int, codecs: Optional[LinkCodecs] = None) -> None:
        if max_live < 1:
            raise ValueError(f"max_live_units={max_live} must be >= 1")
        self.units = list(units)
        self.modules = list(modules)
        self.model = model
        self.comm = comm
        self.codecs = codecs
        """Gathers through the weight codec of ``comm``'s link, if any (Note [quantized collectives]
        in zeroshard/comm/codecs/coded.py): then no gather lends the shard, whose exact values
        the decoded ones must not overwrite."""
        self._exact: set[int] = set()
        """Units gathered by ``ensure_exact`` (no codec, no hpZ secondary) and not released since."""
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
        self._states = UnitStates([u.layout.segments[0].name if u.layout.segments else f"unit {i}"
                                   for i, u in enumerate(self.units)])
        self.hooks = GatherHooks(self)
        """The module hooks that say when each unit is gathered and released."""
        self.sharded: dict[int, nn.Parameter] = {}
        """id(unsharded parameter) -> the sharded Parameter shown outside use (Note [sharded parameters])."""
        self._regs: list[list[tuple[nn.Module, str, nn.Parameter]]] = [[] for _ in self.units]
        self.secondary: Optional[SecondaryPartition] = None
        """hpZ's SecondaryPartition (zeroshard/stages/stage3/secondary.py), which gathers units then."""
        self.forward_check = ForwardAgreement(comm)
        """An evaluation's first forward agrees with the other ranks first (Note [forward on every rank])."""
        self.keep_sharded = False
        """``remove`` leaves the sharded parameters registered (the optimizer was collected at
        world size > 1: ownership.hand_back_collected)."""
        self._make_sharded()

    @property
    def state(self) -> UnitStates:
        """Each unit's ``UnitState`` (``state[ui]``), read-only: only gathering and releasing move it."""
        return self._states

    # -- sharded parameters (Note [sharded parameters]) -------------------------------------------
    def _make_sharded(self) -> None:
        comm = self.comm if self.comm.world_size > 1 else None
        where: dict[int, int] = {}
        for ui, unit in enumerate(self.units):
            lo, hi = unit.owned
            for m, seg in zip(unit.members, unit.layout.segments):
                a, b = max(lo, seg.offset), min(hi, seg.end)
                w = 2 if seg.complex_dtype is not None else 1  # (Note [complex parameters])
                t = ShardedTensor(unit.shard, a - lo if a < b else 0, max(0, b - a) // w, seg.param_shape,
                                  seg.complex_dtype or unit.dtype, m.param.device, max(0, a - seg.offset) // w, comm,
                                  unit, part="shard")
                sp = as_sharded_parameter(m.param, t)  # (a DTensor's: Note [tensor-parallel parameters])
                shown = local_of(sp)  # (a Parameter over a ShardedTensor is one, made by its detach)
                if not isinstance(shown, ShardedTensor):
                    raise RuntimeError(f"the sharded parameter of {seg.name} is a {type(shown).__name__}, "
                                       "not a ShardedTensor")
                shown.on_use = functools.partial(self.hooks.check_use, seg.name)
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

    # -- registration ------------------------------------------------------------------------
    def register(self) -> None:
        self.hooks.register()

    def remove(self) -> None:
        self.hooks.remove()
        for ui in range(len(self.units)):  # the model's own parameters are registered again
            self.show(ui, sharded=self.keep_sharded)

    # -- gather / release ---------------------------------------------------------------------
    def _live(self) -> int:
        return len({self.group_of[i] for i, st in enumerate(self._states)
                    if st is not UnitState.RELEASED and i not in self.roots})

    def _start(self, ui: int) -> None:
        unit = self.units[ui]
        if unit.needs_init:
            raise Stage3UsageError(
                f"unit {ui} ({unit.layout.segments[0].name}, ...) has no values yet: the model was "
                "built on the meta device. Load weights with zeroshard.load_safetensors(model, path) "
                "or initialise them with zeroshard.init_meta_weights(model) before the first forward.")
        unit.await_step(whole=self._waits_whole_step(unit))  # (Note [overlapped step])
        quantized = self.codecs is not None and self.codecs.weights(self.comm.dimension) is not None \
            and ui not in self._exact
        if self.secondary is None and not quantized and can_lend(unit, self.comm.world_size):  # Note [gather by alias]
            lend(unit.flat, unit.shard)
            self._states.reserve(ui, lent=True)
            self._states.launch(ui, self.comm.gather_shards(unit.flat))  # (one rank: nothing to wait for)
            return
        alloc_storage(unit.flat)
        self._states.reserve(ui)
        swap = unit.swap_holding("shard")
        if swap is not None:  # the shard streams in from the swap file first; the
            lo, hi = unit.owned  # collective starts once it is here (_launch)
            if self.secondary is None or ui in self._exact:
                swap.fetch_for_gather(unit, unit.flat[lo:hi], backward=in_backward())
            else:
                swap.fetch(unit, ("shard",))
            return
        self._launch(ui)

    def _launch(self, ui: int) -> None:
        """Starts READING unit ``ui``'s collective: GATHERING from here."""
        if self.secondary is not None and ui not in self._exact:  # hpZ: inside the node (Note [hpZ secondary partition])
            self._states.launch(ui, self.secondary.gather(ui))
            return
        unit = self.units[ui]
        lo, hi = unit.owned
        swap = unit.swap_holding("shard")
        if swap is not None:  # (the shard is dropped unless the parameter cache keeps it)
            swap.finish_gather(unit, unit.flat[lo:hi], backward=in_backward())
        else:
            unit.flat[lo:hi].copy_(unit.shard)
        self._states.launch(ui, self.comm.gather_shards(unit.flat, None if ui in self._exact else self.codecs))

    def _waits_whole_step(self, unit: FlatUnit) -> bool:
        """A unit the parameter cache keeps waits for the whole step in flight: the cache and
        the moments' pool share one memory in the plan (Note [overlapped step])."""
        cache = getattr(unit.swap, "cache", None) if unit.swap is not None else None
        return cache is not None and cache.keep(unit, in_backward())

    def forward_unit_order(self) -> list[int]:
        """Unit indices in the order forward gathers them (the root group first, then the last
        forward's order), then any unit it did not gather: the order an overlapped step takes."""
        seq = ([self.root_group] if self.root_group is not None else []) + list(self.hooks.order or self.hooks.last_order)
        out = list(dict.fromkeys(ui for gi in seq for ui in self.groups[gi]))
        seen = set(out)
        return out + [i for i in range(len(self.units)) if i not in seen]

    def prefetch(self, ui: int) -> None:
        unit = self.units[ui]
        if unit.step_pending(whole=self._waits_whole_step(unit)):
            return  # (a prefetch never waits for the step: the gather itself will)
        state = self._states
        live = state[ui] is not UnitState.RELEASED or any(
            state[i] is not UnitState.RELEASED for i in self.groups[self.group_of[ui]])
        if state[ui] is UnitState.RELEASED and (ui in self.roots or live or self._live() < self.max_live):
            self._start(ui)

    def prefetch_group(self, gi: int) -> None:
        for ui in self.groups[gi]:
            self.prefetch(ui)

    def ensure_group(self, gi: int) -> None:
        for ui in self.groups[gi]:  # every read or collective starts before the first wait
            if self._states[ui] is UnitState.RELEASED:
                self._start(ui)
        for ui in self.groups[gi]:
            self.ensure(ui)

    def ensure(self, ui: int) -> None:
        if self._states[ui] is UnitState.RELEASED:
            self._start(ui)
        if self._states[ui] is UnitState.READING:
            self._launch(ui)
        if self._states[ui] is UnitState.GATHERING:
            self.forward_check.wait(self._states.work(ui), self.model)  # (bounded: Note [bounded divergence])
            self._states.arrive(ui)
            self.show(ui, sharded=False)

    @property
    def quantizes(self) -> bool:
        """Whether some gather of a unit goes through a weight codec (then compute sees decoded
        weights, and what reads weights out uses ``ensure_exact``)."""
        if self.codecs is None:
            return False
        dims = ("shard", "replicate") if self.secondary is not None else (self.comm.dimension,)
        return any(self.codecs.weights(d) is not None for d in dims)

    def ensure_exact(self, ui: int) -> None:
        """``ensure`` with the unit's exact values: gathered from the shards with no codec and
        no hpZ secondary copy (a unit a quantized gather left gathered is gathered again). For
        what reads weights out (state dicts, the hand-back at close, GatheredParameters), not
        for compute (Note [quantized collectives] in zeroshard/comm/codecs/coded.py)."""
        if self.quantizes and ui not in self._exact:
            self.release(ui)
            self._exact.add(ui)
        self.ensure(ui)

    def release(self, ui: int) -> None:
        self._exact.discard(ui)
        state = self._states[ui]
        if state is UnitState.RELEASED:
            return
        unit = self.units[ui]
        if state is UnitState.GATHERING:  # the collective must complete on every rank
            self.forward_check.wait(self._states.work(ui), self.model)
        elif state is UnitState.READING:  # never launched (the same on every rank): drop the read
            swap = unit.swap_holding("shard")
            if swap is not None:
                swap.evict(unit, ("shard",))
        if self._states.release(ui):  # (the shard's memory: never to the host pool)
            take_back(unit.flat)
        else:
            free_storage(unit.flat)
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
        if in_backward():
            raise RuntimeError("a checkpoint cannot be saved from inside backward (a gradient hook): "
                               "save after backward returns, or after catching the KeyboardInterrupt")
        self.release_all()
        for ui, unit in enumerate(self.units):  # (interrupted between allocating and gathering)
            if self._states[ui] is UnitState.RELEASED and is_allocated(unit.flat):
                free_storage(unit.flat)
            self.show(ui, sharded=True)
        self.hooks.backward_queued = False

    def gathered_bytes(self) -> int:
        return sum(held_bytes(u.flat) for u in self.units)

    # -- backward -------------------------------------------------------------------------------
    def before_backward(self, gi: int) -> None:
        """Backward reaches group ``gi``'s module: gathered again, the next groups prefetched."""
        self.hooks.before_backward(gi)

    def on_unit_reduced(self, ui: int) -> None:
        """The unit's gradients are all accumulated and sent: nothing in backward reads it."""
        if ui not in self.roots and in_backward():
            self.release(ui)
