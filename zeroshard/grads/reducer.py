"""Gradient reduction during backward: buckets filled by hooks, launched in a fixed order.

Lifecycle per backward pass: post-accumulate-grad hooks copy each parameter's gradient
into its unit's bucket and free ``param.grad`` at once; a unit whose parameters have all
reported is *ready*; ready units are launched strictly in unit order (every rank must
issue collectives in the same order, and the order in which hooks fire can differ between
ranks when some parameters are unused); an end-of-backward callback launches whatever is
left (unused parameters contribute zeros). At most ``max_inflight`` reductions are in
flight; retiring one adds its result into the unit's fp32 gradient store and frees the
bucket, which is what bounds stage 2's memory to a few buckets.

Note [in-place first pass]: where the gradient store spans the whole unit (stages 0-1, and
stages 2-3 when the shard group has one rank, as in single-GPU offload), the first backward
after zero_grad fills the store itself and reduces it in place: no bucket is allocated and
nothing is copied twice. A store kept in a swap file gets its memory at the unit's first
gradient instead of at the reduction, and is written out from there. Later micro-batches
(gradient accumulation) need a separate bucket, because the store already holds a reduced
sum. (Copying each gradient once into the unit, then reducing, is what every sharded
engine pays; the second copy, bucket to store, was a tenth of stage 3's backward on CPU.)

Note [deferred reduction]: a pass that starts while ``sync`` is False (``optimizer.reducer.deferred()``,
or a pipeline schedule's micro-batches but the last: Note [pipeline parallelism] in
zeroshard/comm/pipeline.py) adds its gradients into the unit buckets and launches nothing:
the buckets, and which segments they hold, carry over to the next pass. The next pass with
``sync`` adds its own and launches each unit as usual, so the micro-batches cost one
reduction of each unit, overlapped with the last backward. Held buckets are unreduced local
sums of the whole unit (what DDP's ``no_sync`` keeps in ``.grad``); a step taken without a
syncing pass reduces them at ``finalize``.
"""
from __future__ import annotations

import contextlib
from collections import deque
from functools import partial
from typing import Iterator, Optional, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.comm import Comm, Work
from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.tensor_parallel import local_grad
from zeroshard.io.host_pool import HOST_POOL
from zeroshard.layout import Segment, as_real
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.testing import kill_points


class _Pending:
    __slots__ = ("unit", "work", "bucket", "shard_out", "base")

    def __init__(self, unit: FlatUnit, work: Work, bucket: torch.Tensor,
                 shard_out: Optional[torch.Tensor], base: int) -> None:
        self.unit, self.work, self.bucket, self.shard_out, self.base = unit, work, bucket, shard_out, base


class GradientReducer:
    def __init__(self, units: Sequence[FlatUnit], comm: Comm, reduce_dtype: torch.dtype,
                 max_inflight: int, replicas: Optional[Comm] = None, codecs: Optional[LinkCodecs] = None) -> None:
        self.units = list(units)
        self.comm = comm
        self.codecs = codecs
        self._unit_index = {id(u): i for i, u in enumerate(self.units)}
        """Quantized reductions, per link (Note [quantized collectives] in zeroshard/comm/codecs/coded.py)."""
        self.replicas = replicas
        """Hybrid sharding: the group of this rank's replicas (same shard, other shard groups)."""
        self.reduce_dtype = reduce_dtype
        self.max_inflight = max_inflight
        self._handles: list[RemovableHandle] = []
        self._inflight: deque[_Pending] = deque()
        self._reset_pass()
        self.touched: list[list[bool]] = [[False] * len(u.layout.segments) for u in self.units]
        """Per unit and segment: a gradient arrived for it since the last clear (see
        zeroshard/grads/untouched.py; parameters no rank saw a gradient for are not stepped)."""
        self.grads_since_clear = False
        """Whether any backward reached the optimizer since the last zero_grad."""
        self.passes = 0
        """Backward passes seen so far (a pass starts with its first gradient hook)."""
        self.grad_factor = 1.0
        """Applied to every reduced gradient as it retires: 1 / (world_size * loss_scale)."""
        self.on_pass_start: list = []
        """Callbacks run when a backward pass reaches the first parameter, before autograd
        accumulates anything into ``.grad``."""
        self.on_pass_end: list = []
        """Callbacks run once a backward pass's reductions are all complete."""
        self.sync = True
        """Whether a backward pass starting now reduces (False: Note [deferred reduction])."""
        self._pass_sync = True
        self.on_launch: list = []
        """Callbacks ``f(unit_index)`` run when a unit's gradients are sent (stage 3 releases
        the unit's gathered parameters then)."""

    @contextlib.contextmanager
    def deferred(self, defer: bool = True) -> Iterator[None]:
        """Backward passes started inside reduce nothing when ``defer`` (Note [deferred reduction])."""
        if defer and any(u.policy.shard_parameters for u in self.units):
            # (stage 3 frees a unit's gathered parameters when its reduction launches)
            raise RuntimeError("deferred reduction is not supported at stage 3: a unit's parameters are released "
                               "when its gradients are reduced; use stage 1 or 2")
        before, self.sync = self.sync, not defer
        try:
            yield
        finally:
            self.sync = before

    def register_hooks(self) -> None:
        for ui, unit in enumerate(self.units):
            for si, (m, seg) in enumerate(zip(unit.members, unit.layout.segments)):
                # Runs before autograd accumulates into .grad: a pass starts there, so every
                # published .grad is detached before autograd could add into it.
                self._handles.append(m.param.register_hook(self._on_incoming_grad))
                self._handles.append(m.param.register_post_accumulate_grad_hook(partial(self._on_grad, ui, si, seg)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reset_pass(self) -> None:
        self._buckets: list[Optional[torch.Tensor]] = [None] * len(self.units)
        self._seen: list[set[int]] = [set() for _ in self.units]
        """Per unit: indices of the segments its bucket holds a gradient of (this pass and
        deferred ones before it)."""
        self._arrived: list[set[int]] = [set() for _ in self.units]
        """Per unit: segment indices whose gradient this pass delivered (a unit is ready once all did)."""
        self._next = 0
        self._in_backward = False

    # -- hooks ------------------------------------------------------------------------------
    def _on_incoming_grad(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._start_pass()

    def _start_pass(self) -> None:
        self._in_backward = True
        self._pass_sync = self.sync  # (read once: a context left inside backward changes nothing)
        self.grads_since_clear = True
        self.passes += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        # The previous micro-batch's last reductions land before this pass writes any
        # bucket: one may be reducing in place in a gradient store (Note [in-place first
        # pass]) that this pass would otherwise take as its bucket again and overwrite.
        while self._inflight:
            self._retire(self._inflight.popleft())
        for callback in self.on_pass_start:
            callback()
        for ui, unit in enumerate(self.units):  # gradients cleared since (model.zero_grad())
            if not unit.grad_valid:
                self.clear_touched(ui)

    def clear_touched(self, ui: int | None = None) -> None:
        for i in range(len(self.units)) if ui is None else (ui,):
            self.touched[i] = [False] * len(self.touched[i])

    def mark_touched(self, ui: int, si: int) -> None:
        self.touched[ui][si] = True

    def _on_grad(self, ui: int, si: int, seg: Segment, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._start_pass()
        grad = param.grad
        param.grad = None  # the bucket holds it now; free the model-sized copy at once
        if grad is None:
            return
        grad = local_grad(param, grad)  # (a DTensor's local shard: Note [tensor-parallel parameters])
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"{seg.name!r} got a {grad.layout} gradient (e.g. nn.Embedding(sparse=True)); ZeroOptimizer "
                "reduces dense flat buffers, so build the module with sparse=False")
        self.touched[ui][si] = True
        if ui < self._next:
            raise RuntimeError(
                f"the gradient of {seg.name!r} arrived after its unit {ui} was already sent for "
                "reduction in this backward pass; this happens when a parameter receives "
                "gradient from a nested backward (e.g. reentrant torch.utils.checkpoint "
                "together with a use outside it). Use torch.utils.checkpoint(..., "
                "use_reentrant=False).")
        bucket = self._bucket(ui)
        dst = bucket[seg.offset:seg.end]
        grad = as_real(grad)  # (Note [complex parameters])
        if si in self._seen[ui]:  # (by segment index: a zero-element parameter shares its offset)
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            self._seen[ui].add(si)
        self._arrived[ui].add(si)
        if self._pass_sync and len(self._arrived[ui]) == len(self.units[ui].layout.segments):
            self._launch_ready()

    def _take_untaken(self) -> None:
        """Ctrl-C as a gradient hook starts leaves the gradient autograd accumulated on the
        parameter, never taken into the bucket; taken now, it is a partial gradient like the
        rest of the abandoned pass (kept until zero_grad, as torch keeps ``.grad``), instead of
        being added to the next pass's gradient of that parameter."""
        for ui in range(self._next, len(self.units)):  # (a launched unit had every gradient taken)
            for si, (m, seg) in enumerate(zip(self.units[ui].members, self.units[ui].layout.segments)):
                if m.param.grad is not None:
                    self._on_grad(ui, si, seg, m.param)

    def _on_backward_end(self) -> None:
        if not self._pass_sync:  # the buckets carry over to the next pass (Note [deferred reduction])
            self._in_backward = False
            self._arrived = [set() for _ in self.units]
            return
        # Like DDP, the pass ends with every reduction complete, so .grad is final when
        # backward returns (Note [visible gradients] in grads/links.py).
        self.flush()
        while self._inflight:
            self._retire(self._inflight.popleft())
        for callback in self.on_pass_end:
            callback()

    def _bucket(self, ui: int) -> torch.Tensor:
        bucket = self._buckets[ui]
        if bucket is None:
            unit = self.units[ui]
            in_place = (unit.grad_spans_unit and not unit.grad_valid
                        and self.reduce_dtype == unit.grad_store.dtype and unit.grad_store.device == unit.device)
            if in_place:  # Note [in-place first pass]
                if unit.swap is not None:  # (allocated, not read: grad_valid is False)
                    unit.swap.load(unit, ("grad",))
                bucket = unit.grad_store
            else:
                bucket = self._new_bucket(unit)
            self._buckets[ui] = bucket
        return bucket

    def _new_bucket(self, unit: FlatUnit) -> torch.Tensor:
        if unit.device.type == "cpu":  # (Note [reused host buffers] in zeroshard/io/host_pool.py)
            return HOST_POOL.empty(unit.layout.padded_numel, self.reduce_dtype)
        return torch.empty(unit.layout.padded_numel, dtype=self.reduce_dtype, device=unit.device)

    # -- launching and retiring ---------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next < len(self.units):
            ui = self._next
            if len(self._arrived[ui]) < len(self.units[ui].layout.segments):
                return
            self._launch(ui)

    def _launch(self, ui: int) -> None:
        unit = self.units[ui]
        bucket = self._bucket(ui)
        # Parameters that got no gradient, and the padding, contribute zeros.
        seen = self._seen[ui]
        for si, seg in enumerate(unit.layout.segments):
            if si not in seen:
                bucket[seg.offset:seg.end].zero_()
        for lo, hi in unit.layout.padding:  # (an owner layout pads between slots too)
            bucket[lo:hi].zero_()
        if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
            kill_points.hit("reduce_scatter")
        while len(self._inflight) >= self.max_inflight:
            self._retire(self._inflight.popleft())
        shard_out, base = None, 0
        if not unit.policy.shard_gradients:  # stages 0-1 keep the whole reduced gradient
            work = self.comm.all_reduce_coded(bucket, self.codecs, str(ui), async_op=True)
        else:
            if not self.comm.result_in_full:
                base, hi = unit.layout.slice_of(self.comm.shard_rank)
                shard_out = torch.empty(hi - base, dtype=bucket.dtype, device=bucket.device)
            work = self.comm.reduce_for_shard(bucket, shard_out, self.codecs, str(ui))
        self._inflight.append(_Pending(unit, work, bucket, shard_out, base))
        self._buckets[ui] = None
        self._next = ui + 1
        for callback in self.on_launch:
            callback(ui)

    def _retire(self, p: _Pending) -> None:
        p.work.wait()
        if self.replicas is not None:  # hybrid: the shard group's sum, summed over replicas too
            self.replicas.all_reduce_coded(self._reduced_part(p), self.codecs, str(self._unit_index[id(p.unit)]))
        if p.bucket is p.unit.grad_store:  # reduced in place: already the sum
            p.unit.reduced_in_place(self.grad_factor)
            return
        p.unit.accumulate(p.bucket if p.shard_out is None else p.shard_out, p.base, self.grad_factor)
        HOST_POOL.release(p.bucket)  # (accumulate copied what it needed; nothing else holds it)

    def _reduced_part(self, p: _Pending) -> torch.Tensor:
        """What this rank keeps of a completed reduction: the whole bucket at stages 0-1, the
        owned slice at stages 2-3 (so replicas exchange only the shard: Note [hybrid sharding])."""
        if not p.unit.policy.shard_gradients:
            return p.bucket
        if p.shard_out is not None:
            return p.shard_out
        lo, hi = p.unit.layout.slice_of(self.comm.shard_rank)
        return p.bucket[lo:hi]

    def live_bucket_bytes(self) -> int:
        """Bytes of buckets alive now that are not a unit's own gradient store."""
        stores = {id(u.grad_store) for u in self.units}
        live = [b for b in self._buckets if b is not None] + [p.bucket for p in self._inflight]
        live += [p.shard_out for p in self._inflight if p.shard_out is not None]
        return sum(b.numel() * b.element_size() for b in live if id(b) not in stores)

    def flush(self) -> None:
        """Launch every unit not yet launched in this pass (end of backward)."""
        for ui in range(self._next, len(self.units)):
            self._launch(ui)
        self._reset_pass()

    def finalize(self) -> None:
        """Complete all reductions: afterwards every unit's gradient store is final."""
        if self._in_backward:  # (outside backward: the pass was abandoned, Note [abandoned backward])
            self._take_untaken()
        if self._next > 0 or any(self._seen):
            self.flush()
        elif self._in_backward:
            # A pass that ended before any gradient reached a bucket (an exception or Ctrl-C in
            # backward: its end-of-backward callback never ran) started no collective; left
            # marked as running, the next backward would skip its start (joining a step in
            # flight, reconciling .grad) and its end (the flush), and train on wrong gradients.
            self._reset_pass()
        while self._inflight:
            self._retire(self._inflight.popleft())
