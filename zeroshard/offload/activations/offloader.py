"""``ActivationOffloader``: the covered blocks' saved tensors leave the device after their forward
and come back ahead of their backward (Note [activation offload]).

Note [activation offload]: while the model's forward runs (a forward pre-hook on the module
the optimizer was given, popped by an always-called forward hook), this object is autograd's
innermost ``saved_tensors_hooks``. In a covered block's forward (its own pre- and post-hooks
bracket it) each saved tensor worth moving is held in the block's ``BlockActivations``;
when the block's forward returns they are copied into one host buffer (the host pool's; pinned
on a GPU) and, under "nvme", written to one file through the async I/O engine, and the device
lets go of them. A block run under ``torch.utils.checkpoint(use_reentrant=False)`` saves
nothing through these hooks inside it (the checkpoint's own hooks are innermost there): what
the checkpoint keeps is its input, which torch saves through the hooks active at the call,
ours, just before the block's pre-hook runs; the pre-hook adopts that pending save into the
block's record, so a checkpointed block's input is what moves. Parameters (and views of
their storage: the flat units') are never moved, nor tensors under ``min_bytes``, nor ones
whose bytes do not cover their memory exactly (a copy would change their strides, and
backward's bits with them). In backward the first unpack of a record waits for it and starts
bringing back the ``prefetch`` records before it in forward order; the start of the forward's
backward starts the last ones (Note [activation offload under pipeline schedules]). Bytes are
copied exactly, RNG is not touched (checkpointing keeps its own RNG state), so gradients are
the same bits as without offload.

Note [activation offload under torch.compile]: dynamo graph-breaks at the offloader's hooks
(they take a lock and enter ``saved_tensors_hooks``), so they run eagerly between compiled
pieces: the blocks move and gradients are the same bits (torch 2.13, aot_eager; tests/offload/
test_activation_offload_auto.py). But dynamo does not guard a compiled module call on the
module's hooks: a graph compiled before the offloader existed (for this model, or another
instance of its class) is reused and the hooks silently never run. Each backward therefore
checks that its forward ran the hooks (``at_backward``, on the reducer's pass start) and
refuses with the fix (``torch._dynamo.reset()`` after building the optimizer) when it did not.
Under inductor a model compiled whole is refused at its first forward (Note [activation offload
under inductor] in compiled_split.py): split at the hooks, inductor's graphs give other bits.

Note [activation offload under pipeline schedules]: a pipeline schedule (GPipe, 1F1B; Note
[pipeline parallelism]) runs the stage module's forward once per micro-batch, several of them
before the first one's backward. Each forward is its own pass: its records (one per block and
micro-batch, numbered by call) live in that forward's graph, and each saved tensor's handle
names its record, so a backward unpacks exactly its own micro-batch's bytes whatever the order.
The last ``prefetch`` records of a forward are brought back when its backward starts (a hook
on the forward's output gradient), not when the forward ends: otherwise every micro-batch in
flight would bring its last blocks back at once, long before their backward. A forward whose
output is not one tensor that requires grad starts them at its end, as before. NVMe files are
under the process's global rank (the dp group's rank repeats across stages).

Note [activation copies on a GPU]: on CUDA the copies out run on a side stream after the
compute stream's work so far (``wait_stream``), the source tensors are marked used there
(``record_stream``), so the caching allocator reuses their memory only after the copy; the
copies back run on the same stream (ordered after the copy out) and the compute stream waits
on their event. Not exercised by the CPU test suite: benchmarks/bench_activation_offload.py
carries the GPU check.
"""
from __future__ import annotations

import os
import shutil
import threading
import weakref
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.io.aio_engine import AsyncIO
from zeroshard.offload.activations.block_checkpoint import BlockCheckpointing
from zeroshard.offload.activations.block_record import BlockActivations, RecordState, _key, dense_span
from zeroshard.offload.activations.activation_options import ActivationOffload
from zeroshard.stages.stage3.gather_hooks import in_backward
from zeroshard.stages.stage3.units import _repeated_blocks
from zeroshard.units.tier import Tier

if TYPE_CHECKING:
    from zeroshard.offload.activations.plan_at_forward import ForwardPlanner


_ACTIVE = [0]  # (how many offloaders' hooks are pushed now: deepspeed.checkpointing leaves the inputs to them)


def hooks_active() -> bool:
    """An activation offloader's hooks are autograd's now (a covered model's forward is running)."""
    return _ACTIVE[0] > 0


class _Saved:
    """What autograd keeps for a saved tensor we may move: the tensor itself until a block's
    record adopts it, then the record and the entry."""
    __slots__ = ("tensor", "record", "index")

    def __init__(self, tensor: Optional[torch.Tensor], record: Optional[BlockActivations] = None,
                 index: int = 0) -> None:
        self.tensor, self.record, self.index = tensor, record, index


def covered_blocks(model: nn.Module, names: Optional[tuple[str, ...]]) -> dict[int, str]:
    """id(module) -> qualified name of the blocks to cover: by class or module name, or the model's
    repeated blocks."""
    qualified = {id(m): n for n, m in model.named_modules()}
    if names is None:
        found = _repeated_blocks(model) or _keyed_blocks(model)
        if not found:
            raise ValueError(
                f"offload_activations: {type(model).__name__} has no repeated blocks (children of a ModuleList, "
                "Sequential or ModuleDict of one class) to cover; name the modules: ActivationOffload(where=..., blocks=(...)) "
                "with class names or module names from model.named_modules()")
        return {id(m): qualified[id(m)] for m in found}
    wanted = set(names)
    picked = [(n, m) for n, m in model.named_modules() if m is not model and (n in wanted or type(m).__name__ in wanted)]
    out: dict[int, str] = {}
    for n, m in picked:  # (pre-order: a module inside one already covered is part of it)
        if not any(n.startswith(o + ".") for o in out.values()):
            out[id(m)] = n
    if not out:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"ActivationOffload(blocks={list(names)}) matches no module of {type(model).__name__}; "
                         f"its module classes are {classes} (or give names from model.named_modules())")
    return out


def _keyed_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of a ModuleDict of one class (two at least): a pipeline stage module keeps its
    layers under their index in the full model that way (Note [pipeline parallelism])."""
    for m in model.modules():
        children = list(m.children()) if isinstance(m, nn.ModuleDict) else []
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            return children
    return []


def _storages(module: nn.Module) -> set[int]:
    """The storage addresses of ``module``'s parameters that hold memory now (stage 3's released
    parameters have none)."""
    out = set()
    for p in module.parameters():
        try:
            out.add(p.untyped_storage().data_ptr())
        except RuntimeError:  # (an invalid storage: released)
            pass
    return out


class ActivationOffloader:
    def __init__(self, options: ActivationOffload, model: nn.Module, rank: int, device: torch.device,
                 steps_done: Callable[[], int], planner: Optional["ForwardPlanner"] = None) -> None:
        # (imported here: it imports torch._dynamo, 1.3 s of CPU that a process without activation
        # offload should not pay; Note [pipelining imported on first use] in comm/pipeline.py)
        from zeroshard.offload.activations.compiled_split import refuse_inductor_split
        self._refuse_inductor_split = refuse_inductor_split
        self.options = options
        self.host_blocks: frozenset[str] = frozenset()
        """Under "nvme", the blocks whose inputs the plan puts in host memory instead (Note
        [activations under the budget] in planned.py)."""
        self.planned: Optional[dict] = None
        """``offload="auto"``'s activation plan in force, for the report."""
        self.model = model
        self.device = device
        self.planner = planner
        """``offload="auto"``: plans (again) at a forward's first block; the blocks then come from it."""
        self.blocks: dict[int, str] = covered_blocks(model, options.blocks) if planner is None else {}
        """The blocks whose saved tensors move now (id -> name)."""
        self._hooked = self.blocks if planner is None else planner.candidates
        self._steps_done = steps_done
        self._io: Optional[AsyncIO] = None
        self.directory: Optional[str] = None
        self._rank = rank
        if options.tier is Tier.NVME and planner is None:
            self._open_files()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._hooks_ctx: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._depth = 0
        self._current: Optional[tuple[nn.Module, BlockActivations]] = None
        self._pending: list[_Saved] = []
        self._pass: list[BlockActivations] = []
        self._pass_refs: list[weakref.ref] = []
        self._calls = 0
        self._forwards = 0
        self._model_forwards = 0
        self._param_storages: set[int] = set()
        self._window_step = -1
        self._out = self._in = 0
        self.last_step_bytes = (0, 0)
        """(bytes moved off the device, bytes brought back) in the last whole step."""
        self.blocks_moved = 0
        self._measure_ids: frozenset[int] = frozenset()
        self._measuring: Optional[tuple[nn.Module, set, list[int]]] = None
        self._measured: list[int] = []
        """Blocks the plan keeps but measures (Note [mixed activation plans]): their saved bytes this forward."""
        self._planned_this_pass = False
        self._handles: list[RemovableHandle] = [] if not self._hooked else [
            model.register_forward_pre_hook(self._model_pre),
            model.register_forward_hook(self._model_post, always_call=True)]
        if planner is not None and planner.measures_input:  # (first: before stage 3's root hooks gather anything)
            self._handles.append(model.register_forward_pre_hook(self._model_input, prepend=True, with_kwargs=True))
        for m in model.modules():
            if id(m) in self._hooked:
                self._handles.append(m.register_forward_pre_hook(self._block_pre))
                self._handles.append(m.register_forward_hook(self._block_post, always_call=True))
        wanted = planner.wanted if planner is not None else None
        self.checkpointing = BlockCheckpointing([m for m in model.modules() if id(m) in self._hooked],
                                                lambda: self._depth > 0) if (
            wanted is not None and not wanted.checkpointed and wanted.recompute) else None
        """Blocks not checkpointed by the model: runs those the plan picks under checkpoint (Note
        [checkpointing chosen blocks] in block_checkpoint.py)."""
        placed = planner.initial() if planner is not None else None
        if placed is not None:
            self.apply(*placed)

    def _open_files(self) -> None:
        assert self.options.path is not None
        # (by the process's global rank: the group rank repeats across pipeline stages, tp and replicas)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else self._rank
        self.directory = os.path.join(str(self.options.path), f"activations-rank{rank:05d}")
        os.makedirs(self.directory, exist_ok=True)
        self._io = AsyncIO()  # (O_DIRECT where the file system takes it: the page cache would hold the bytes moved)

    def apply(self, cover: dict[int, str], host_blocks: frozenset[str], planned: dict) -> None:
        """A plan (Note [activations under the budget] in planned.py): from the next block on, the
        blocks in ``cover`` move, to host memory for those in ``host_blocks``, else to NVMe files."""
        if any(n not in host_blocks for n in cover.values()) and self._io is None:
            if self.options.tier is not Tier.NVME:
                raise RuntimeError(f"activation offload: the plan puts blocks on NVMe ({sorted(cover.values())}) but "
                                   "no nvme_path was given; pass nvme_path=<directory>")
            self._open_files()
        self.blocks, self.host_blocks, self.planned = dict(cover), host_blocks, planned
        if self.checkpointing is not None:
            names = set(planned.get("recompute", ()))
            self.checkpointing.chosen = frozenset(k for k, n in self._hooked.items() if n in names)
        self._measure_ids = frozenset(k for k, n in self._hooked.items() if n in set(planned.get("measure", ())))

    # -- the model's forward ---------------------------------------------------------------------
    def _model_pre(self, module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        if self._depth == 0 and self._hooked:
            self._refuse_inductor_split(self.model, self.options.inductor_split)
        self._depth += 1
        if self._depth > 1:
            return
        self._model_forwards += 1
        steps = self._steps_done()
        if steps != self._window_step:
            if self._window_step >= 0:
                self.last_step_bytes = (self._out, self._in)
            self._window_step, self._out, self._in = steps, 0, 0
        self._param_storages = _storages(self.model)
        self._planned_this_pass = False
        self._measured, self._measuring = [], None
        self._pass = []
        self._pass_refs = []  # (weak: a record must go with the graph that holds it)
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        _ACTIVE[0] += 1

    def _model_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Stage 3: the first forward's plan from the model's input, before any unit is gathered (Note
        [state re-placed at the first forward] in zeroshard/offload/placement_replan.py)."""
        if self.planner is None or self._depth or not torch.is_grad_enabled() or in_backward():
            return  # (a nested call, an evaluation, a recomputation in backward)
        placed = self.planner.at_root(args, kwargs)
        if placed is not None:
            self.apply(*placed)

    def _model_post(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        ctx, self._hooks_ctx = self._hooks_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
            _ACTIVE[0] -= 1
        self._pending = []
        self._current = None
        records, self._pass = self._pass, []
        try:
            for r in records:
                r.written(wait=True)
        except RuntimeError:
            for r in records:
                r.discard()
            raise
        tail = [weakref.ref(r) for r in records[-self.options.prefetch:]]
        grad_out = output if isinstance(output, torch.Tensor) and output.requires_grad else None
        if grad_out is None:
            self._bring_back(tail)
        else:  # (Note [activation offload under pipeline schedules])
            grad_out.register_hook(lambda grad: self._bring_back(tail))
        moved = [r.moved for r in records] + self._measured
        placed = self.planner.after_forward(moved) if self.planner is not None else None
        if placed is not None:  # (the blocks' saved bytes measured: planned with them from the next forward)
            self.apply(*placed)

    def _bring_back(self, refs: list[weakref.ref]) -> None:
        """Starts bringing back these records of one forward (its last ones, as its backward starts)."""
        try:
            for ref in refs:
                r = ref()
                if r is not None:
                    r.prefetch(self._io_of(r))
        except BaseException:  # (a SIGINT: the backward is abandoned, its pass's files go, as in _unpack)
            last = refs[-1]() if refs else None
            for r in (ref() for ref in (last.neighbours if last is not None else [])):
                if r is not None:
                    r.abandon()
            raise

    # -- a covered block's forward ---------------------------------------------------------------
    def _block_pre(self, module: nn.Module, args: tuple) -> None:
        if self._depth == 0 or self._current is not None:  # (recomputation in backward; a block inside one)
            return
        self._forwards += 1
        if self.planner is not None and not self._planned_this_pass:  # (before any block: the plan holds all of them)
            self._planned_this_pass = True
            placed = self.planner.at_forward(next((a for a in args if isinstance(a, torch.Tensor)), None))
            if placed is not None:
                self.apply(*placed)
        if self.checkpointing is not None:
            self.checkpointing.arm(module)
        if id(module) in self._measure_ids:  # (kept, its saved bytes counted as they are saved)
            self._measuring = (module, set(), [0])
        if id(module) not in self.blocks:  # (a block the plan leaves on the device)
            self._pending = []
            return
        self._calls += 1
        record = BlockActivations(self.blocks[id(module)], self._calls, self.device, self._stream)
        self._param_storages |= _storages(module)  # (stage 3: gathered by now)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        for saved in self._pending:  # (a checkpoint's input, saved just before this call)
            t = saved.tensor
            if t is not None and any(t.data_ptr() == a.data_ptr() and t.shape == a.shape for a in inputs):
                saved.record, saved.index, saved.tensor = record, record.add(t), None
        self._pending = []
        self._current = (module, record)

    def _block_post(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._measuring is not None and self._measuring[0] is module:
            self._measured.append(self._measuring[2][0])
            self._measuring = None
        if self._current is None or self._current[0] is not module:
            return
        record = self._current[1]
        self._current = None
        self._pending = []
        if not record.entries:
            return
        record.neighbours, record.position = self._pass_refs, len(self._pass)
        self._pass.append(record)
        self._pass_refs.append(weakref.ref(record))
        try:
            to_file = self._io is not None and record.block not in self.host_blocks
            record.move_out(self._io if to_file else None, self.directory if to_file else None)
            # (writes in flight are bounded: each holds a staging buffer of its block)
            for r in self._pass[:-self.options.prefetch]:
                r.written(wait=True)
        except RuntimeError:
            for r in self._pass:
                r.discard()
            self._pass = []
            raise
        self._out += record.moved
        self.blocks_moved += 1

    # -- autograd's hooks ------------------------------------------------------------------------
    def _worth_moving(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type != self.device.type:
            return False  # (parameters are nn.Parameter; subclasses and sparse tensors stay)
        if t.numel() * t.element_size() < self.options.min_bytes or not dense_span(t):
            return False
        base = t._base
        return not isinstance(base, nn.Parameter) and t.untyped_storage().data_ptr() not in self._param_storages

    def _pack(self, t: torch.Tensor) -> object:
        if not self._worth_moving(t):
            return t
        if self._current is None and self._measuring is not None:
            seen, total = self._measuring[1], self._measuring[2]
            if _key(t) not in seen:  # (as a record counts it: once per tensor)
                seen.add(_key(t))
                total[0] += t.numel() * t.element_size()
            return t
        if self._current is None:
            saved = _Saved(t)
            self._pending.append(saved)
            return saved
        record = self._current[1]
        return _Saved(None, record, record.add(t))

    def _unpack(self, saved: object) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        assert isinstance(saved, _Saved)
        record = saved.record
        if record is None:
            assert saved.tensor is not None
            return saved.tensor
        first = record.state is RecordState.OUT or record.state is RecordState.LOADING
        try:
            out = record.tensor(saved.index, self._io_of(record))
        except BaseException:  # (the backward is abandoned, a SIGINT too: its pass's files go now, not when the graph does)
            for ref in record.neighbours:
                r = ref()
                if r is not None:
                    r.abandon()
            raise
        if first:
            with self._lock:
                self._in += record.moved
            for ref in record.neighbours[max(0, record.position - self.options.prefetch):record.position]:
                r = ref()
                if r is not None:
                    r.prefetch(self._io_of(r))
        return out

    def _io_of(self, record: BlockActivations) -> Optional[AsyncIO]:
        return self._io if record.path is not None else None  # (a record the plan kept in host memory: no file)

    def at_backward(self) -> None:
        """A backward starts: its forward must have run our blocks' hooks (Note [activation offload under
        torch.compile]); a RuntimeError naming the fix when it did not."""
        seen, self._forwards = self._forwards, 0
        ran, self._model_forwards = self._model_forwards, 0
        if self._hooked and ran and not seen:  # (no forward since the last backward: retain_graph, nothing to check)
            raise RuntimeError(
                f"activation offload: a backward started, but the forward before it did not run the offloader's "
                f"hooks on {type(self.model).__name__}'s blocks, so nothing was offloaded. This happens under torch.compile "
                "when a graph compiled before the ZeroOptimizer was built (for this model or another of its class) "
                "is reused: dynamo does not guard a compiled call on module hooks. Call torch._dynamo.reset() "
                "after building the ZeroOptimizer (or build it before the first torch.compile call), or call the "
                "model itself rather than its forward()")

    # -- reports and lifetime --------------------------------------------------------------------
    def report(self) -> dict:
        """What activation offload did: where, the blocks covered, bytes moved in the last whole
        step (off the device and back) and so far in this one."""
        last, now = self.last_step_bytes, (self._out, self._in)
        if self._window_step >= 0 and self._steps_done() != self._window_step:  # (a step ended since the forward)
            last, now = now, (0, 0)
        where = self.options.where
        if self.planner is not None:  # (the plan in force says: any block to files, or all in host memory)
            where = "nvme" if set(self.blocks.values()) - self.host_blocks else "cpu"
        return {"where": where, "blocks": sorted(set(self.blocks.values())),
                "prefetch": self.options.prefetch, "directory": self.directory,
                "bytes_out_last_step": last[0], "bytes_in_last_step": last[1], "bytes_moved_last_step": sum(last),
                "bytes_out_this_step": now[0], "bytes_in_this_step": now[1],
                **({"plan": self.planned} if self.planned is not None else {})}

    def remove(self) -> None:
        """Detaches from the model and closes the I/O engine; the activation files go with it."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.checkpointing is not None:
            self.checkpointing.remove()
        if self._io is not None:
            self._io.close()
            self._io = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
