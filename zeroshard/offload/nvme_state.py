"""Adam/AdamW moments in a swap file on NVMe, streamed through a small pool of buffers.

``offload_optimizer="nvme"`` keeps each run's ``exp_avg`` and ``exp_avg_sq`` (8 bytes per
parameter: the bulk of the training state) in one preallocated swap file per rank. The
step walks the runs in order through a pool of three aligned buffers: while run ``i`` is
updated by the fused CPU kernel, run ``i+1`` is being read and run ``i-1`` written, so host
memory holds three runs' moments, not the model's (``pool_bytes``). Step counts stay in
memory. The gradients and any separate fp32 master are swapped too, in a second file
(``zeroshard/offload/unit_swap.py``; with ``offload_params="nvme"`` the shards as well): the
step reads unit ``i+1``'s master and gradient while unit ``i`` is updated and writes unit
``i``'s new master back behind it. (An fp32 model's master *is* its parameters: at stages
1-2 they stay in memory, being the model.)

Under ``offload="auto"`` some runs keep their moments in memory instead (``resident``, chosen
by the planner: Note [automatic placement] in zeroshard/planner/auto_placement.py), in buffers laid
out like a pool slot and updated by the same kernel in the same pass; only the others have a
region in the file (and without any, there is no file).

The object is also the inner optimizer's ``state`` mapping: reading ``state[run.tensor]``
reads that run's moments from the file, assigning writes them, so state dicts and
checkpoints stream run by run through the same code as in-memory state.

The file is allocated in full at construction (``posix_fallocate``), so a disk that is too
small fails there, with the size needed, and never in the middle of a step with half the
runs updated. Swap files are scratch: each run creates its own (named by rank and pid) and
state comes back from checkpoints, so a file truncated or damaged between runs is never
read; one deleted, truncated or zero-filled during a run fails the next read, naming it
(Note [guarded swap files] in ``swap_file.py``).

Note [untouched parts of a streamed run]: torch.optim leaves a parameter whose ``.grad`` is None
alone (no decay, no moment update, no step count). In memory each parameter is its own run and such a
run is simply not stepped (Note [one run per parameter] in zeroshard/optim/kernel_choice.py); here a run
spans a unit's group (the moments stream run by run in aligned regions), so a run with some untouched
parameters is stepped whole with zero gradients there: AdamW decayed them (1.1e-3 off torch after 3
steps, an unused Linear at lr 1e-2, weight decay 0.1). The stepper now passes the untouched parameters'
element ranges (``untouched.partly_untouched``); the stream copies their values and both moments before
the kernel and puts them back after it, so they are exactly as before the step, as in torch. What is
still shared is the run's one step count: a parameter untouched for some steps and used again later
gets the run's bias correction, not the one of its own (smaller) count. Runs of another optimizer class
(``generic``: stepped by that class, whatever state it keeps) are still stepped whole.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from zeroshard.io import ALIGN, aligned_empty
from zeroshard.offload.nvme_generic_state import GenericRecords, GenericRun, Pending
from zeroshard.offload.swap_file import SwapFile, aligned
from zeroshard.ops import adam_step_

if TYPE_CHECKING:
    from zeroshard.io.aio_engine import AsyncIO
    from zeroshard.units.flat_unit import FlatUnit

KEYS = ("exp_avg", "exp_avg_sq")


class NvmeOptimizerState(MutableMapping):
    def __init__(self, runs: Sequence[Any], nvme_path: Optional[str], rank: int, max_slots: int = 3,
                 resident: Collection[int] = (), release_pool: bool = False,
                 generic: Optional[dict[int, GenericRun]] = None,
                 step_fn: Optional[Callable[[torch.optim.Optimizer], object]] = None) -> None:
        """``resident``: ``id(run.tensor)`` of the runs whose moments automatic placement keeps
        in memory (same layout as a pool slot, updated by the same kernel); the others stream.
        ``release_pool``: the pool exists only during ``step`` (its memory serves the parameter
        cache during forward and backward: zeroshard/offload/param_cache.py). ``generic``: the
        runs a class of their own steps (``step_fn(part)``), with state of any shape (Note
        [generic state on NVMe] in nvme_generic_state.py)."""
        generic = generic or {}
        self.runs = list(runs)
        self.file: Optional[SwapFile] = None
        self.path: Optional[str] = None
        self.aio: Optional[AsyncIO] = None
        self._where = (nvme_path, rank, max_slots)  # (the file's, and the pool's bound: ``re_place`` too)
        self._lay_out(resident, generic)
        self.release_pool = release_pool
        self._pool: list[torch.Tensor] = []
        self.pool_bytes = 0
        """Bytes of the pool held now."""
        if not release_pool:
            self._allocate_pool()
        self._steps: dict[int, torch.Tensor] = {}
        self._keys = {id(r.tensor): r.tensor for r in self.runs}
        self.generic = GenericRecords(generic, self._generic_offset, lambda buf, off: self._swap_file().pread(buf, off),
                                      lambda buf, off: self._swap_file().pwrite(buf, off),
                                      step_fn or (lambda part: part.step()))
        self.before_close: list[Callable[[], None]] = []
        """Run once by ``close`` before the file goes (the optimizer's teardown joins a step in flight)."""

    def _lay_out(self, resident: Collection[int], generic: dict[int, GenericRun]) -> None:
        """Which runs keep their moments in memory, each streamed run's region in the file (created
        and allocated here when some run streams) and the pool's slots."""
        self._offset: dict[int, int] = {}
        self._resident: dict[int, torch.Tensor] = {
            id(r.tensor): aligned_empty(aligned(r.tensor.numel() * 4) * len(KEYS) // 4, torch.float32)
            for r in self.runs if id(r.tensor) in resident and id(r.tensor) not in generic}
        self.resident_bytes = sum(b.numel() * 4 for b in self._resident.values())
        streamed = [r for r in self.runs if id(r.tensor) not in self._resident and id(r.tensor) not in generic]
        offset = 0
        for run in streamed:
            self._offset[id(run.tensor)] = offset
            offset += aligned(run.tensor.numel() * 4) * len(KEYS)
        self._generic_offset: dict[int, int] = {}
        for run in self.runs:
            if id(run.tensor) in generic and id(run.tensor) not in resident:
                self._generic_offset[id(run.tensor)] = offset
                offset += generic[id(run.tensor)].region_bytes
        self.resident_bytes += sum(generic[i].region_bytes for i in generic if i not in self._generic_offset)
        self.file_bytes = 0
        self._reserve(offset)
        self._size_pool([r.tensor for r in streamed], self._where[2])

    def _reserve(self, end: int) -> None:
        """Regions up to byte ``end`` of the file (created with the first region), allocated on disk now."""
        if end <= self.file_bytes:
            return
        nvme_path, rank, _ = self._where
        if nvme_path is None:
            raise RuntimeError("NvmeOptimizerState: runs stream their moments to a swap file, but no nvme_path "
                               "was given (configuration requires nvme_path for offload to 'nvme')")
        if self.file is None:
            self.file = SwapFile(nvme_path, "optim", rank)
        self.path = self.file.path
        self.file.reserve(self.file_bytes, end - self.file_bytes,
                          "offload_optimizer='nvme' needs {gib} GiB for this rank's optimizer state")
        self.aio = self.file.aio
        self.file_bytes = end

    def _size_pool(self, streamed: Sequence[torch.Tensor], max_slots: int) -> None:
        """The pool's slots for the streamed runs (their tensors)."""
        largest = max((aligned(t.numel() * 4) for t in streamed), default=ALIGN)
        # Three slots overlap read, update and write; fewer runs need fewer slots (a one-unit
        # model must not hold 3x the moments it offloads).
        self._slots = max(1, min(3, max_slots, len(streamed))) if streamed else 0
        self._slot_numel = largest * len(KEYS) // 4

    def re_place(self, resident: Collection[int]) -> None:
        """Keeps the moments of ``resident`` runs in memory and streams the others from now on (Note
        [state re-placed at the first forward] in zeroshard/offload/placement_replan.py): a run leaving
        memory gets a region at the file's end and its moments (if it has any yet: a checkpoint loaded)
        are written there, a run coming back gets a buffer its moments are read into; the others stay
        where they are (the file, scratch, keeps the regions given up)."""
        if self.generic.runs:
            raise RuntimeError(f"NvmeOptimizerState.re_place: {len(self.generic.runs)} run(s) of a class of their "
                               "own stream here, whose state is not re-placed")
        for r in self.runs:
            t = r.tensor
            if id(t) in self._offset and id(t) in resident:
                buf = aligned_empty(self._region(t)[1] // 4, torch.float32)
                if id(t) in self._steps:
                    self._read(t, buf).wait()
                del self._offset[id(t)]
                self._resident[id(t)] = buf
        leaving = [r.tensor for r in self.runs if id(r.tensor) in self._resident and id(r.tensor) not in resident]
        end = self.file_bytes
        for t in leaving:
            self._offset[id(t)], end = end, end + aligned(t.numel() * 4) * len(KEYS)
        self._reserve(end)
        for t in leaving:
            buf = self._resident.pop(id(t))
            if id(t) in self._steps:
                self._write(t, buf).wait()
        self.resident_bytes = sum(b.numel() * 4 for b in self._resident.values())
        self._size_pool([r.tensor for r in self.runs if id(r.tensor) in self._offset], self._where[2])
        self._pool, self.pool_bytes = [], 0
        if not self.release_pool:
            self._allocate_pool()

    def _allocate_pool(self) -> None:
        try:
            self._pool = [aligned_empty(self._slot_numel, torch.float32) for _ in range(self._slots)]
        except RuntimeError as exc:  # e.g. pinned or aligned host memory exhausted
            raise RuntimeError(f"offload_optimizer='nvme' could not allocate its {self._slots} staging buffers of "
                               f"{self._slot_numel * 4 / 2**20:.1f} MiB ({exc}); lower offload_buffer_mb, or make "
                               "units smaller (bucket_size_mb, or stage3_unit_numel at stage 3)") from exc
        self.pool_bytes = sum(b.numel() * 4 for b in self._pool)

    # -- layout ---------------------------------------------------------------------------------
    def _views(self, buf: torch.Tensor, numel: int) -> list[torch.Tensor]:
        stride = aligned(numel * 4) // 4
        return [buf[k * stride:k * stride + numel] for k in range(len(KEYS))]

    def _region(self, t: torch.Tensor) -> tuple[int, int]:
        return self._offset[id(t)], aligned(t.numel() * 4) * len(KEYS)

    def _swap_file(self) -> SwapFile:
        if self.file is None:  # only streamed runs have a region, and they create the file
            raise RuntimeError("NvmeOptimizerState: a streamed run's moments are accessed, but there is no swap file")
        return self.file

    def _read(self, t: torch.Tensor, buf: torch.Tensor):
        off, nbytes = self._region(t)
        return self._swap_file().pread(buf[:nbytes // 4], off)

    def _write(self, t: torch.Tensor, buf: torch.Tensor):
        off, nbytes = self._region(t)
        return self._swap_file().pwrite(buf[:nbytes // 4], off)

    def in_memory(self, t: torch.Tensor) -> bool:
        """The run's moments stay in memory (automatic placement) rather than stream."""
        return id(t) in self._resident or (t in self.generic and id(t) not in self.generic.file_offset)

    def state_bytes(self, t: torch.Tensor) -> int:
        """Bytes of the run's tensor state (in memory or in the file)."""
        return self.generic.runs[id(t)].region_bytes if t in self.generic else aligned(t.numel() * 4) * len(KEYS)

    # -- piecewise access (checkpoints stream through these) ------------------------------------
    def scalars(self, t: torch.Tensor) -> dict:
        """The run's state that is not one value per element (Adam's step; a generic run's
        scalars and per-tensor state such as Adafactor's factors, read from the file); {}
        before a step."""
        if t in self.generic:
            elementwise = self.generic.elementwise_keys(t)
            return {k: v for k, v in self.generic.read(t).items() if k not in elementwise}
        return {"step": self._steps[id(t)].clone()} if id(t) in self._steps else {}

    def tensor_keys_of(self, t: torch.Tensor) -> tuple[str, ...]:
        """The run's state keys with one value per element (read piecewise by ``read_range``)."""
        if t in self.generic:
            return self.generic.elementwise_keys(t) if self.generic.has_state(t) else ()
        return KEYS if id(t) in self._steps else ()

    def key_dtype(self, t: torch.Tensor, key: str) -> torch.dtype:
        return self.generic.dtype(t, key) if t in self.generic else torch.float32

    def read_range(self, t: torch.Tensor, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the run's ``key`` moment, read from the file."""
        if t in self.generic:
            return self.generic.read(t, tensors_only=True)[key].reshape(-1)[lo:hi].clone()
        if key not in KEYS:
            raise KeyError(key)
        if id(t) in self._resident:
            return self._views(self._resident[id(t)], t.numel())[KEYS.index(key)][lo:hi].clone()
        out = torch.empty(hi - lo, dtype=torch.float32)
        if hi > lo:
            base = self._offset[id(t)] + KEYS.index(key) * aligned(t.numel() * 4)
            self._swap_file().pread(out, base + lo * 4).wait()
        return out

    # -- the mapping the inner optimizer and the checkpoint code see ---------------------------
    def __getitem__(self, t: torch.Tensor) -> dict:
        if t in self.generic and self.generic.has_state(t):
            return self.generic.read(t)
        if id(t) not in self._steps:
            raise KeyError(t)
        buf = self._resident.get(id(t))
        if buf is None:
            buf = aligned_empty(self._region(t)[1] // 4, torch.float32)
            self._read(t, buf).wait()
        return {"step": self._steps[id(t)].clone(),
                **{k: v.clone() for k, v in zip(KEYS, self._views(buf, t.numel()))}}

    def __setitem__(self, t: torch.Tensor, state: dict) -> None:
        if t in self.generic:
            self.generic.write(t, state)
            return
        if id(t) not in self._offset and id(t) not in self._resident:
            raise KeyError(f"tensor of shape {tuple(t.shape)} is not a run of this optimizer")
        missing = [k for k in ("step", *KEYS) if k not in state]
        if missing:
            raise ValueError(f"Adam state for an offloaded run lacks {missing}")
        kept = self._resident.get(id(t))
        buf = kept if kept is not None else aligned_empty(self._region(t)[1] // 4, torch.float32)
        for view, k in zip(self._views(buf, t.numel()), KEYS):
            view.copy_(state[k].reshape(-1))
        if kept is None:
            self._write(t, buf).wait()
        step = state["step"]
        self._steps[id(t)] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step))).detach().clone()

    def __delitem__(self, t: torch.Tensor) -> None:
        if t in self.generic:
            self.generic.forget(t)
            return
        del self._steps[id(t)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([self._keys[i] for i in self._steps] + [self._keys[i] for i in self.generic.scalars])

    def __len__(self) -> int:
        return len(self._steps) + len(self.generic.scalars)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, param_groups: Sequence[dict], grad_scale: float = 1.0,
             untouched: Optional[dict[int, list[tuple[int, int]]]] = None) -> None:
        """One Adam/AdamW step over every run with a gradient (``prepare``, then ``run``)."""
        self.run(self.prepare(param_groups, untouched=untouched), grad_scale)

    def prepare(self, param_groups: Sequence[dict], unit_order: Optional[Sequence["FlatUnit"]] = None,
                untouched: Optional[dict[int, list[tuple[int, int]]]] = None) -> list[tuple]:
        """What a step updates, taken in the caller's thread so that the step may run in
        another (Note [overlapped step] in zeroshard/units/step_in_flight.py): each run with a
        gradient, that gradient, and its group's hyperparameters as they are now; units in
        ``unit_order`` first, in that order (each run's update is independent of the others).
        ``untouched``: element ranges of runs whose parameters there got no gradient, kept as they
        are (Note [untouched parts of a streamed run])."""
        todo = [r for r in self.runs if r.tensor.grad is not None and r.unit.grad_valid and r.tensor.numel()]
        if unit_order is not None:
            pos = {id(u): k for k, u in enumerate(unit_order)}
            todo.sort(key=lambda r: pos.get(id(r.unit), len(pos)))  # (stable: runs keep their order)
        hyper = [{"lr": float(g["lr"]), "betas": tuple(float(b) for b in g["betas"]), "eps": float(g["eps"]),
                  "weight_decay": float(g["weight_decay"]), "adamw_mode": bool(g["adamw_mode"]),
                  "maximize": bool(g.get("maximize", False))} if "adamw_mode" in g else {}  # (generic: its class's)
                 for g in param_groups]
        kept = untouched or {}
        return [(r, r.tensor.grad, {**hyper[r.group], "untouched": kept[id(r.tensor)]} if id(r.tensor) in kept
                 else hyper[r.group]) for r in todo]

    @torch.no_grad()
    def run(self, todo: Sequence[tuple], grad_scale: float = 1.0,
            unit_done: Optional[Callable[[Any], None]] = None) -> None:
        """The step ``prepare`` described, pipelined through the pool; ``grad_scale`` (a pending
        clip coefficient) multiplies the gradients in the kernel. Units kept in a swap file
        (``unit.swap``) are read ahead one unit and written back (master, then the
        low-precision shard) as soon as their last run is updated; ``unit_done(unit)`` is
        called then, once the unit's new weights are in memory or being written."""
        swapped = [r.unit for r, _, _ in todo if getattr(r.unit, "swap", None) is not None]
        order = list(dict.fromkeys(swapped))  # units in step order, once each
        last_run = {id(r.unit): i for i, (r, _, _) in enumerate(todo)}
        upcoming = iter(order)

        def fetch(u: "FlatUnit") -> None:  # a separate low-precision shard is rewritten whole: not read
            if u.swap is not None:  # (every unit in ``order`` has one)
                u.swap.fetch(u, u.swap.parts_of(u), skip_read=("shard",) if u.separate_master else ())

        def fetch_next() -> None:
            u = next(upcoming, None)
            if u is not None:
                fetch(u)
        if len(self._pool) < self._slots:
            self._allocate_pool()
        fetch_next()
        current = None
        reads: dict[int, Any] = {}
        started: set[int] = set()
        slots = len(self._pool)
        writes: list[Any] = [None] * slots
        stream = [i for i, (r, _, _) in enumerate(todo) if id(r.tensor) not in self._resident and r.tensor not in self.generic]
        generic_writes: list[Optional[Pending]] = []
        slot_of = {i: k % max(1, slots) for k, i in enumerate(stream)}
        after = dict(zip(stream, stream[1:]))  # the next streamed run

        def start_read(i: int) -> None:
            slot = slot_of[i]
            if writes[slot] is not None:  # the buffer is still being written from an earlier run
                writes[slot].wait()
                writes[slot] = None
            t = todo[i][0].tensor
            if id(t) in self._steps:
                reads[i] = self._read(t, self._pool[slot])
            else:  # first step: moments start at zero
                self._pool[slot][:self._region(t)[1] // 4].zero_()
            started.add(i)
        if stream:
            start_read(stream[0])
        for i, (run, grad, group) in enumerate(todo):
            t = run.tensor
            kept = self._resident.get(id(t))
            if t in self.generic:
                pass  # (stepped below, once its unit is in memory)
            elif kept is None:
                if i not in started:
                    start_read(i)
                if slots > 1 and i in after and after[i] not in started:  # read ahead into the next slot
                    start_read(after[i])
                if i in reads:
                    reads.pop(i).wait()
            elif id(t) not in self._steps:  # first step: moments start at zero
                kept.zero_()
            unit = run.unit
            store = getattr(unit, "swap", None)
            if store is not None and unit is not current:
                current = unit
                fetch(unit)  # (already in flight when read ahead)
                store.wait_fetch(unit, store.parts_of(unit))
                if store.max_in_flight > 1:
                    fetch_next()  # the next unit streams in while this one is updated
            if t in self.generic:
                generic_writes.append(self.generic.step(t, grad_scale))
                if len(generic_writes) > 2:  # (two runs' state in flight at most)
                    done = generic_writes.pop(0)
                    if done is not None:
                        done.wait()
                self._unit_stepped(run.unit, last_run[id(run.unit)] == i, unit_done)
                continue
            step = self._steps.setdefault(id(t), torch.tensor(0.0))
            step += 1
            beta1, beta2 = group["betas"]
            buf = kept if kept is not None else self._pool[slot_of[i]]
            exp_avg, exp_avg_sq = self._views(buf, t.numel())
            held = [(a, b, t[a:b].clone(), exp_avg[a:b].clone(), exp_avg_sq[a:b].clone())
                    for a, b in group.get("untouched", ())]  # (Note [untouched parts of a streamed run])
            adam_step_(t, grad, exp_avg, exp_avg_sq, step=int(step.item()), lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       adamw_mode=group["adamw_mode"], grad_scale=-grad_scale if group["maximize"] else grad_scale)
            for a, b, p, m, v in held:
                t[a:b], exp_avg[a:b], exp_avg_sq[a:b] = p, m, v
            if kept is None:
                writes[slot_of[i]] = self._write(t, buf)
            self._unit_stepped(run.unit, last_run[id(run.unit)] == i, unit_done)
        for w in generic_writes:
            if w is not None:
                w.wait()
        for u in order:
            u.swap.settle(u)
        for w in writes:
            if w is not None:
                w.wait()
        if self.release_pool:
            self._pool, self.pool_bytes = [], 0

    @staticmethod
    def _unit_stepped(unit: FlatUnit, last: bool, unit_done: Optional[Callable[[FlatUnit], None]]) -> None:
        """After a run: once its unit's ``last`` run is updated, the unit's new weights go back."""
        if not last:
            return
        unit.write_back()  # the low-precision shard from the new master
        store = unit.swap
        if store is not None:
            store.evict(unit, ("grad",))  # its file copy is current
            store.flush(unit, [p for p in store.parts_of(unit) if p != "grad"])
        if unit_done is not None:
            unit_done(unit)

    def close(self) -> None:
        run, self.before_close = self.before_close, []
        for action in run:
            action()
        if self.file is not None:
            self.file.close()
