"""The tensors of one flat unit on one rank, and their lifecycle across a step.

A ``FlatUnit`` owns:
- ``shard``: the owned range of the unit's parameters in the model dtype. At stages 0-2 it
  is a view of ``flat``; at stage 3 it is the only parameter memory that persists;
- ``flat``: the full parameter buffer. Every model parameter of the unit is a view into it,
  so a gather writes straight into the model. Stages 0-2 keep it; at stage 3 it exists only
  while the unit is gathered (``zeroshard/stages/stage3/gatherer.py`` manages that);
- ``master``: the fp32 values of the owned range that the optimizer updates. Without
  mixed precision it *is* ``shard`` (no copy, no extra memory);
- ``grad_store``: reduced gradients, summed over ranks and micro-batches, in fp32: the
  whole unit (stages 0-1) or only the owned range (stages 2-3).

With ``offload_optimizer="nvme"`` a unit is adopted by a swap file (``swap``, see
zeroshard/offload/unit_swap.py): ``grad_store``, a separate ``master`` and, with
``offload_params="nvme"``, ``shard`` then hold memory only while someone uses them, and
the methods below read or write the file where needed.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Optional, Protocol, Sequence

import torch

from zeroshard.comm.tensor_parallel import is_dtensor, local_of
from zeroshard.io.buffers import advise_huge_pages, resizable_aligned, storage_bytes
from zeroshard.io.host_pool import HOST_POOL
from zeroshard.layout import NamedParam, UnitLayout, as_real, real_dtype
from zeroshard.config import Placement
from zeroshard.ops.sqnorm import squared_norm_f64
from zeroshard.units.stage_policy import StagePolicy


# Note [the store a unit calls back]: the NVMe store (zeroshard/offload/unit_swap.py,
# ``NvmeUnitStore``) sits above the unit: it adopts units and the unit calls back only through
# ``PartStore``, so the bottom layer never imports offload/ (Note [the layers] in docs/design.md).
# A part is one of a unit's tensors by name: "shard", "master" or "grad".
class PartStore(Protocol):
    def parts_of(self, unit: "FlatUnit") -> tuple[str, ...]:
        """The parts of ``unit`` the store holds."""
        ...

    def swaps(self, unit: "FlatUnit", part: str) -> bool:
        ...

    def fetch(self, unit: "FlatUnit", parts: Iterable[str], skip_read: Iterable[str] = (),
              urgent: bool = False) -> None:
        """Starts reading ``parts`` into memory (``skip_read``: allocated, not read)."""
        ...

    def load(self, unit: "FlatUnit", parts: Iterable[str]) -> None:
        """Reads ``parts`` into memory and waits for them."""
        ...

    def flush(self, unit: "FlatUnit", parts: Iterable[str], release: bool = True) -> None:
        """Writes ``parts`` back in the background (freed once written with ``release``)."""
        ...

    def settle(self, unit: "Optional[FlatUnit]" = None) -> None:
        """Waits for the unit's (or every unit's) writes in flight."""
        ...

    def forget(self, unit: "FlatUnit", part: str) -> None:
        """``part``'s value is gone (gradients set to None): a held copy is dropped unwritten."""
        ...

    def read_range(self, unit: "FlatUnit", part: str, a: int, b: int) -> torch.Tensor:
        ...

    def write_range(self, unit: "FlatUnit", part: str, a: int, values: torch.Tensor) -> None:
        ...

    def touched(self, unit: "FlatUnit", part: str, write: bool) -> AbstractContextManager[None]:
        """``part`` in memory for torch code (Note [parts held for torch code])."""
        ...

    def sized(self, unit: "FlatUnit") -> AbstractContextManager[None]:
        ...

    def resident(self, unit: "FlatUnit", parts: Sequence[str], write: bool = False) -> AbstractContextManager[None]:
        """``parts`` in memory for the block (written back after it with ``write``)."""
        ...

    def evict(self, unit: "FlatUnit", parts: Iterable[str]) -> None:
        ...

    def fetch_for_gather(self, unit: "FlatUnit", dest: torch.Tensor, backward: bool) -> None:
        """Starts reading the unit's shard into ``dest`` for a stage-3 gather."""
        ...

    def finish_gather(self, unit: "FlatUnit", dest: torch.Tensor, backward: bool) -> None:
        ...


class StepWaiter(Protocol):
    """The optimizer's step that may still be updating units in the background (``StepInFlight``,
    Note [overlapped step] in zeroshard/units/step_in_flight.py)."""

    @property
    def running(self) -> bool:
        ...

    def wait_unit(self, unit: "FlatUnit", whole: bool = False) -> None:
        ...

    def ready(self, unit: "FlatUnit", whole: bool = False) -> bool:
        ...


def free_storage(t: torch.Tensor) -> None:
    """Releases ``t``'s memory but keeps the storage object, so every view of it (model
    parameters, and tensors autograd saved from them) sees the data again once
    ``alloc_storage`` re-allocates it and a gather refills it. See Note [released parameters]
    in zeroshard/stages/stage3/gatherer.py. The memory is kept for the next buffer of its size
    (Note [reused host buffers] in zeroshard/io/host_pool.py)."""
    HOST_POOL.release(t)


def alloc_storage(t: torch.Tensor) -> None:
    HOST_POOL.acquire(t, storage_bytes(t))  # (Note [aligned swap parts])


def is_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def _part(numel: int, dtype: torch.dtype, device: torch.device, pin: bool, swappable: bool,
          zero: bool = True) -> torch.Tensor:
    """A unit part; one a swap file may hold is 4096-aligned (Note [aligned swap parts])."""
    if swappable and device.type == "cpu" and not pin:
        t = resizable_aligned(numel, dtype)
    else:
        t = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
        advise_huge_pages(t)
    return t.zero_() if zero else t


class FlatUnit:
    def __init__(self, layout: UnitLayout, members: Sequence[NamedParam], policy: StagePolicy,
                 rank: int, param_dtype: torch.dtype, device: Optional[torch.device] = None,
                 placement: Optional[Placement] = None, frozen: bool = False,
                 step_in_flight: Optional[StepWaiter] = None) -> None:
        self.layout = layout
        self.frozen = frozen
        self.writes = 0
        """Times ``load_segment`` wrote values (what a cache of the frozen weights' digest keys on)."""
        """Frozen parameters only (stage 3, Note [frozen units] in zeroshard/stages/stage3/frozen.py):
        a shard and the gathered buffer in the model dtype, no master, gradient or optimizer state."""
        self.members = list(members)
        self.swap: Optional[PartStore] = None
        """The swap file that holds some of this unit's parts between uses (NVMe offload)."""
        self.step_in_flight = step_in_flight
        """The optimizer's ``StepInFlight``: what reads this unit's parts outside the optimizer
        waits on it (Note [overlapped step] in zeroshard/units/step_in_flight.py)."""
        self.policy = policy
        param_dtype = real_dtype(param_dtype)  # (complex parameters are reals here: Note [complex parameters])
        self.dtype = param_dtype
        self.device = device or self.members[0].param.device
        placement = placement or Placement()
        state_device = placement.optimizer_device(self.device)
        shard_device = placement.param_device(self.device)
        # Pinned host memory only pays off (and only exists) next to an accelerator.
        pin = placement.pin and self.device.type != "cpu"
        self.owned = layout.slice_of(rank) if policy.shard_optimizer else (0, layout.padded_numel)
        lo, hi = self.owned
        # fp32 masters and gradients under a narrower model dtype; a wider one (float64) keeps
        # its own precision, as torch.optim does (a 1e-9 update on 1.0 is lost in fp32).
        self.state_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
        self.separate_master = param_dtype != self.state_dtype and not frozen
        self.needs_init = any(m.param.is_meta or local_of(m.param).numel() != m.true_shape.numel()
                              for m in self.members)
        """Parameters had no values (meta device): the owner must initialise the shard."""
        # Parts a swap file may hold are 4096-aligned (Note [aligned swap parts], io/buffers.py):
        # the file reads and writes them with O_DIRECT, a stage-3 shard straight into ``flat``.
        params_swap = placement.params_swapped and policy.shard_parameters
        state_swap = placement.state_swapped
        self.flat = _part(layout.padded_numel, param_dtype, self.device, False, params_swap)
        if policy.shard_parameters:
            self.shard = _part(hi - lo, param_dtype, shard_device, pin and shard_device.type == "cpu", params_swap)
        else:
            self.shard = self.flat[lo:hi]
        # fp32 master and optimizer state live where the placement says; a master on another
        # device than the model (CPU offload with a GPU model) is a separate copy.
        self.separate_master = not frozen and (self.separate_master or state_device != self.shard.device)
        self.master = (_part(hi - lo, self.state_dtype, state_device, pin and state_device.type == "cpu", state_swap)
                       if self.separate_master else self.shard)
        with torch.no_grad():
            for m, seg in zip(self.members, layout.segments):
                if not self.needs_init:
                    self.load_segment(seg.offset, local_of(m.param).detach().reshape(-1))
                if is_dtensor(m.param):  # Note [tensor-parallel parameters]: its local shard is the view
                    m.param._local_tensor = seg.bind(self.flat[seg.offset:seg.end])
                else:
                    m.param.data = seg.bind(self.flat[seg.offset:seg.end])
        if policy.shard_parameters:  # only the shard persists; gathers refill ``flat``
            free_storage(self.flat)
        self.grad_base = lo if policy.shard_gradients else 0
        store_numel = 0 if frozen else hi - lo if policy.shard_gradients else layout.padded_numel
        # Uninitialised on purpose: grad_valid=False makes the first reduction overwrite it, and
        # untouched pages cost no resident memory until the first backward (a model loaded for
        # inference or resumed from a checkpoint does not pay for gradients it never computes).
        self.grad_store = _part(store_numel, self.state_dtype, state_device, pin and state_device.type == "cpu",
                                state_swap, zero=False)
        self.grad_valid = False
        """False after zero_grad(set_to_none=True): the next reduced gradient overwrites."""
        self.grad_stats: Optional[dict] = None
        """Swapped gradients only: the owned gradient's squared 2-norm and finiteness as of its
        last change, so clipping and the fp16 overflow check need not read it back from the
        swap file (the same expressions the optimizer would evaluate, hence the same bits)."""

    def await_step(self, whole: bool = False) -> None:
        """Returns once a step in flight has updated this unit (``whole``: once the step is
        done; Note [overlapped step])."""
        s = self.step_in_flight
        if s is not None and s.running:
            s.wait_unit(self, whole=whole)

    def step_pending(self, whole: bool = False) -> bool:
        """A step in flight has not updated this unit yet (``await_step`` would wait)."""
        s = self.step_in_flight
        return s is not None and s.running and not s.ready(self, whole=whole)

    def swapped(self, part: str) -> bool:
        """``part`` ("shard", "master" or "grad") lives in the swap file between uses."""
        return self.swap_holding(part) is not None

    def swap_holding(self, part: str) -> Optional[PartStore]:
        """The swap file ``part`` lives in between uses; None when it stays in memory."""
        return self.swap if self.swap is not None and self.swap.swaps(self, part) else None

    def load_segment(self, offset: int, values: torch.Tensor) -> None:
        """Sets the unit range starting at ``offset`` from full-precision ``values``: the
        model-dtype copy wherever this rank holds it, and the fp32 master of the owned part."""
        values = as_real(values).reshape(-1)  # (a complex parameter's values: Note [complex parameters])
        end = offset + values.numel()
        self.writes += 1
        if is_allocated(self.flat):
            self.flat[offset:end].copy_(values)
        lo, hi = self.owned
        a, b = max(lo, offset), min(hi, end)
        if a < b:  # swapped parts go straight to the file: nothing becomes resident
            shard_swap, master_swap = self.swap_holding("shard"), self.swap_holding("master")
            if shard_swap is not None:
                shard_swap.write_range(self, "shard", a, values[a - offset:b - offset])
            elif self.policy.shard_parameters:  # otherwise shard is a view of flat: done
                self.shard[a - lo:b - lo].copy_(values[a - offset:b - offset])
            if master_swap is not None:
                master_swap.write_range(self, "master", a, values[a - offset:b - offset])
            elif self.separate_master:  # the master keeps the full-precision values
                self.master[a - lo:b - lo].copy_(values[a - offset:b - offset])

    # -- ranges ---------------------------------------------------------------------------
    def grad_range(self, a: int, b: int) -> torch.Tensor:
        return self.grad_store[a - self.grad_base:b - self.grad_base]

    def master_range(self, a: int, b: int) -> torch.Tensor:
        lo = self.owned[0]
        return self.master[a - lo:b - lo]

    def param_range(self, a: int, b: int) -> torch.Tensor:
        """Model-dtype values of unit range ``[a, b)``: any range at stages 0-2, the owned
        range at stage 3 (other ranges live on other ranks)."""
        if not self.policy.shard_parameters:
            return self.flat[a:b]
        lo, hi = self.owned
        if not lo <= a <= b <= hi:
            raise ValueError(f"unit {self.layout.index}: range [{a}, {b}) is outside this rank's "
                             f"owned range [{lo}, {hi}) and stage 3 holds nothing else")
        return self.shard[a - lo:b - lo]

    @property
    def grad_spans_unit(self) -> bool:
        """The gradient store covers the whole padded unit (stages 0-1, or a shard group of one
        rank), so a backward's bucket can be the store itself (Note [in-place first pass] in
        zeroshard/grads/reducer.py)."""
        return self.grad_base == 0 and self.grad_store.numel() == self.layout.padded_numel

    def owned_grad(self) -> torch.Tensor:
        return self.grad_range(*self.owned)

    # -- step lifecycle -------------------------------------------------------------------
    def accumulate(self, reduced: torch.Tensor, base: int, factor: float) -> None:
        """Add ``factor *`` a reduced gradient whose element 0 sits at unit offset ``base``."""
        a = self.grad_base
        src = reduced[a - base:a - base + self.grad_store.numel()]
        if src.device != self.grad_store.device:  # offloaded: device -> host, per unit
            src = src.to(self.grad_store.device)
        if self.swap is not None:  # the earlier micro-batches' sum comes back from the file
            self.swap.load(self, ("grad",))
        if self.grad_valid:
            self.grad_store.add_(src, alpha=factor)
        else:
            torch.mul(src, factor, out=self.grad_store)
        self._grad_final()

    def reduced_in_place(self, factor: float) -> None:
        """The store itself was the bucket and holds the reduced sum (Note [in-place first pass]
        in zeroshard/grads/reducer.py): scale it by ``factor``."""
        if factor != 1.0:
            self.grad_store.mul_(factor)
        self._grad_final()

    def _grad_final(self) -> None:
        self.grad_valid = True
        if self.swap is not None:  # written in the background, released once written
            self.note_grad_stats()
            self.swap.flush(self, ("grad",))

    def note_grad_stats(self) -> None:
        # Every element is finite exactly when the float64 sum of squares is: squares of floats
        # cannot overflow a double, and a float32 sum (which could) is not needed.
        sqnorm = squared_norm_f64(self.owned_grad())
        self.grad_stats = {"sqnorm": sqnorm, "finite": bool(torch.isfinite(sqnorm))}

    def write_back(self, non_blocking: bool = False) -> None:
        """Copy updated master values into the model-dtype shard (mixed precision, or a master
        in host memory for a shard on a device: then ``non_blocking`` from pinned memory)."""
        if self.separate_master:
            self.shard.copy_(self.master, non_blocking=non_blocking)

    def clear_grads(self, set_to_none: bool) -> None:
        self.grad_stats = None
        if set_to_none:
            self.grad_valid = False
            store = self.swap_holding("grad")
            if store is not None:  # (a copy torch code touched is dropped unwritten)
                store.forget(self, "grad")
        elif self.swap is not None:
            self.grad_valid = False  # fetch allocates without reading; zeros go to the file
            self.swap.load(self, ("grad",))
            self.grad_store.zero_()
            self.grad_valid = True
            self.note_grad_stats()
            self.swap.flush(self, ("grad",))
        else:
            self.grad_store.zero_()
            self.grad_valid = True
