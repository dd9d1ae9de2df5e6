"""``ShardedTensor``: a parameter or gradient whose elements are spread over the ranks.

Two uses, one type:
- ``param.grad`` when it cannot be a plain view of the gradient store (Note [visible
  gradients] in zeroshard/grads/links.py): this rank's fp32 piece at stages 2-3, or the
  whole fp32 gradient behind a bf16/fp16 parameter or a swap file;
- a stage-3 parameter outside the forward and backward of its unit (Note [sharded
  parameters] in zeroshard/stages/stage3/gatherer.py): the owned piece of the unit's shard.

It has the full tensor's shape, dtype and device (so autograd, ``nn.Module``,
``clip_grad_norm_`` and ``GradScaler`` accept it) and reads ``local``, its part:
- sharded: the piece ``[start, start + n)`` of the flattened tensor that this rank owns; the
  other pieces live on other ranks (``comm``);
- whole: ``local`` is everything, and ops run on ``local.view(shape)``.

Note [sharded tensor ops]: what torch code does with these is answered exactly, as DTensor
answers it, but over zeroshard's element-range shards:
- pointwise ops (``mul_`` by a clip coefficient, ``abs``, ``isfinite``, ``zero_``, ``copy_``
  from a full tensor, ...) run on the local piece; results stay sharded;
- full reductions (``linalg_vector_norm``, ``norm``, ``sum``, ``amax``, ``all``, ...) reduce
  the local piece, then across ranks, and return an ordinary tensor with the global value;
- ``GradScaler``'s unscale-and-check runs on the local pieces and the found-inf flag is
  agreed by all ranks (MAX), so every rank skips the same steps;
- anything else gathers the whole tensor (a collective, with a warning once per op), runs the
  op on it and, for an in-place op, keeps the local piece of the result;
- an in-place op on a parameter writes through its unit (``FlatUnit.load_segment``), so the
  fp32 master, a gathered copy and a swap file all follow (``model.load_state_dict``).
Every rank must therefore run the same ops in the same order (SPMD code does; code that
inspects gradients on rank 0 only must use ``local_part(t)``, which never communicates).
``torch.save`` stores this rank's piece (``local`` and where it sits); loading it back on the
same rank and world size restores it through ``load_state_dict``.
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, SupportsIndex, cast

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from zeroshard.comm import Comm
from zeroshard.layout import real_dtype
from zeroshard.ops.sqnorm import squared_norm_f64
from zeroshard.stages.dcp_chunks import DcpChunks
from zeroshard.stages.stage3.secondary import params_written

if TYPE_CHECKING:
    from zeroshard.units.flat_unit import FlatUnit

aten = torch.ops.aten

_ALIASES = {aten.detach.default, aten.alias.default}
_WARNED: set[str] = set()


class ShardedTensor(DcpChunks, torch.Tensor):  # (DcpChunks: torch DCP reads and writes its chunks)
    store: torch.Tensor
    lo: int
    n: int
    start: int
    whole: bool
    width: int
    comm: Optional[Comm]
    unit: Optional[FlatUnit]
    part: str
    on_use: Optional[Callable[[object], None]]
    gathered: Optional[torch.Tensor]
    """The whole tensor while a ``GatheredParameters`` block holds it (Note [gathered reads])."""

    @staticmethod
    def __new__(cls, store: torch.Tensor, lo: int, n: int, shape: torch.Size, dtype: torch.dtype,
                device: torch.device, start: int, comm: Optional[Comm] = None, unit: Optional[FlatUnit] = None, *,
                whole: Optional[bool] = None, part: str = "grad", requires_grad: bool = False) -> "ShardedTensor":
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        r.store, r.lo, r.n, r.start, r.comm, r.unit, r.part = store, lo, n, start, comm, unit, part
        r.whole = comm is None if whole is None else whole
        # a complex tensor over a real store: ``lo`` counts reals, ``n`` and ``start`` complex
        # elements (Note [complex parameters] in zeroshard/layout/unit_layout.py)
        r.width = 2 if dtype.is_complex and not store.is_complex() else 1
        r.on_use = None
        r.gathered = None
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @property
    def local(self) -> torch.Tensor:
        """This rank's part, 1-D. Sliced on each use: a swapped store has no memory between
        uses (dispatch reads it in first), so a view made earlier could not exist."""
        t = self.store[self.lo:self.lo + self.n * self.width]
        return torch.view_as_complex(t.view(-1, 2)) if self.width == 2 else t

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Note [saving pieces]: a whole tensor pickles as a plain one, so ``torch.save`` of a
        one-rank stage-3 ``model.state_dict()`` loads in a process that never imports zeroshard
        (nanoGPT's ``sample.py``). A piece of a tensor sharded over ranks cannot become weights
        in any file: a file written from one rank (nanoGPT saves on ``master_process``; the DDP
        idiom "rank 0 saves, every rank loads") would hold only that rank's elements. Refusing
        the save on the saving rank left the others waiting in the script's next barrier, to die
        with "Connection closed by peer" (issue 43). So the save warns (``ShardOnlySaveWarning``,
        the fix) and the piece pickles as a record of where it sat (``_saved_piece``); every rank
        that loads the file into a model a ZeroOptimizer manages refuses it with one error
        (``refuse_saved_pieces``, a load pre-hook), before anything is copied, so all stay in
        step. In-memory copies (``copy.deepcopy(model.state_dict())``) keep pieces and load back."""
        if self.gathered is not None:  # (inside GatheredParameters: the whole tensor, Note [gathered reads])
            return self.gathered.detach().clone().__reduce_ex__(protocol)
        if self.sharded:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = self.comm.world_size if self.comm is not None else -1
            warnings.warn(
                # (the text names no tensor: Python shows a warning once per text, so a state
                # dict of many pieces warns once, not once per tensor)
                f"torch.save of pieces of sharded tensors on rank {rank}: a stage-3 "
                "model.state_dict() (or a stage-2/3 gradient) holds only this rank's piece of each tensor, so "
                "the file cannot be loaded as weights (loading it into the model is refused on every rank). "
                "Save the full weights with sd = zeroshard.full_state_dict(model) on every rank (a collective; "
                "rank 0 gets them) and torch.save(sd, path) on rank 0, or the whole training state with "
                "zeroshard.save_checkpoint(...) (Note [saving pieces])", ShardOnlySaveWarning, stacklevel=2)
            return (_saved_piece, (list(self.shape), rank, world))
        with _resident([self], False):
            local = self.local.detach().clone()
        return local.view(self.shape).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> "ShardedTensor":
        with _resident([self], False):
            local = self.local.detach().clone()
        copy = _rebuild_piece(local, tuple(self.shape), self.dtype, self.start, self.whole)
        memo[id(self)] = copy
        return copy

    @property
    def sharded(self) -> bool:
        """Whether other ranks hold other pieces (False: ``local`` is the whole tensor)."""
        return not self.whole

    # (mypy reads torch's Tensor.__repr__ with its keyword's name lost, ``*, Any = ...``: no override matches)
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # never a collective
        where = (f"elements [{self.start}, {self.start + self.n}) of {math.prod(self.shape)} on this rank"
                 if self.sharded else "whole")
        kind = "Parameter" if isinstance(self, torch.nn.Parameter) else "ShardedTensor"
        return f"{kind}(shape={tuple(self.shape)}, dtype={self.dtype}, {where})"

    def like(self, local: torch.Tensor, dtype: Optional[torch.dtype] = None) -> "ShardedTensor":
        """A tensor with this one's layout over ``local`` (an op's result, in memory)."""
        return ShardedTensor(local, 0, local.numel(), self.shape, dtype or self.dtype, self.device, self.start,
                             self.comm, None, whole=self.whole)

    def full(self) -> torch.Tensor:
        """The whole tensor as an ordinary one (a collective when sharded)."""
        if not self.sharded:
            return self.local.view(self.shape)
        comm = _need_comm(self)
        buf = torch.zeros(math.prod(self.shape), dtype=self.local.dtype, device=self.local.device)
        buf[self.start:self.start + self.n] = self.local
        comm.all_reduce(buf, what="sharded_gather")  # other ranks add exact zeros: a copy, bit for bit
        return buf.view(self.shape)

    # torch's tensor-subclass protocol: classmethods, where torch's stubs declare plain functions
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod  # (the protocol's signature, not the stub's)
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, ShardedTensor) and a.gathered is not None for a in _flat(args, kwargs)):
            return _on_gathered(func, args, kwargs)
        grads = [a for a in _flat(args, kwargs) if isinstance(a, ShardedTensor)]
        for g in grads:
            if g.on_use is not None and func not in _ALIASES:
                g.on_use(func)
        if _mutates(func) and args and isinstance(args[0], ShardedTensor) and args[0].part == "shard":
            return _write_params(func, args, kwargs, grads)
        if func in _ALIASES:  # (a view of the same piece: no data is read)
            return _dispatch(func, args, kwargs, grads)
        with _resident(grads, _mutates(func)):
            return _dispatch(func, args, kwargs, grads)


def _on_gathered(func: Callable[..., object], args: tuple, kwargs: dict) -> object:
    """Note [gathered reads]: inside ``deepspeed.zero.GatheredParameters(params)`` the
    parameters named are whole, as under DeepSpeed: an op on one (``p.detach().float().cpu()``,
    the usual way a script saves stage-3 weights on rank 0) runs on the gathered tensor and
    gives ordinary tensors. An in-place write lands in the gathered copy, which the block
    broadcasts from its ``modifier_rank`` and writes into every shard on exit (without one,
    it is discarded, as DeepSpeed discards it)."""
    def whole(x: object) -> object:
        return x.gathered if isinstance(x, ShardedTensor) and x.gathered is not None else x
    out = func(*tree_map(whole, args), **tree_map(whole, kwargs))
    if _mutates(func) and args and isinstance(args[0], ShardedTensor):
        return args[0]
    return out


def local_part(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part of ``t`` (e.g. ``param.grad``) with no communication: the whole tensor
    where this rank holds it, or the flat owned piece at stages 2-3 (possibly empty)."""
    return t.local if isinstance(t, ShardedTensor) else t


def _rebuild_piece(local: torch.Tensor, shape: tuple, dtype: torch.dtype, start: int, whole: bool) -> ShardedTensor:
    """A piece that knows where it sits, detached from any run: a deep copy, or what
    ``torch.save`` stored before Note [saving pieces] (such files still load)."""
    return ShardedTensor(local, 0, local.numel(), torch.Size(shape), dtype, local.device, start, None, None,
                         whole=whole, part="saved")


torch.serialization.add_safe_globals([_rebuild_piece])  # torch.load(weights_only=True) may build pieces

PIECE_KEY = "zeroshard_piece_of_sharded_tensor"


class ShardOnlySaveWarning(RuntimeWarning):
    """torch.save wrote state one rank holds only a shard of (a ZeroOptimizer's sharded state
    dict saved by one rank alone, or pieces of stage-3 parameters): the file cannot resume."""


def _saved_piece(shape: list[int], rank: int, world_size: int) -> dict:
    """What a pickled piece loads as (plain data: torch.load(weights_only=True) builds it; Note
    [saving pieces])."""
    return {PIECE_KEY: True, "shape": [int(n) for n in shape], "rank": int(rank), "world_size": int(world_size)}


torch.serialization.add_safe_globals([_saved_piece])


def refuse_saved_pieces(state_dict: Mapping[str, object]) -> None:
    """Refuses a state dict holding pickled pieces of sharded tensors, naming them and the fix
    (the same words on every rank that loads the same file: Note [saving pieces])."""
    pieces = [k for k, v in state_dict.items() if isinstance(v, dict) and v.get(PIECE_KEY) is True]
    if not pieces:
        return
    first = cast("dict[str, object]", state_dict[pieces[0]])
    raise ValueError(
        f"this state dict was saved with torch.save from a stage-3 model.state_dict() over {first['world_size']} "
        f"ranks, by rank {first['rank']}: its {len(pieces)} entries (e.g. {pieces[0]!r}, shape {first['shape']}) hold "
        "no values, since each rank held only a piece of each tensor. Save the full weights with "
        "sd = zeroshard.full_state_dict(model) on every rank (a collective; rank 0 gets them) and torch.save(sd, "
        "path) on rank 0, or the whole training state with zeroshard.save_checkpoint(...) (Note [saving pieces])")


def _need_comm(t: ShardedTensor) -> Comm:
    """``t``'s communicator; a piece saved by one rank has none, and is refused."""
    if t.comm is None:
        raise RuntimeError(
            f"{t!r} is a piece saved by one rank (torch.save of a stage-3 model.state_dict()); its other "
            "pieces are not here. Load it with model.load_state_dict() on the same rank and world size, "
            "or save whole tensors with zeroshard.full_state_dict(model) or zeroshard.save_checkpoint")
    return t.comm


def _write_params(func: Any, args: tuple, kwargs: dict, grads: list[ShardedTensor]) -> Any:
    """An in-place op on stage-3 parameters: computed on a copy of each piece, then written
    through the unit so its fp32 master, a gathered copy and a swap file follow."""
    targets = {id(args[0]): args[0]} if args[0].unit is not None else {}
    with _resident(grads, False):
        temps = {i: ShardedTensor(g.local.clone(), 0, g.n, g.shape, g.dtype, g.device, g.start, g.comm,
                                  None, whole=g.whole, part="tmp") for i, g in targets.items()}
    swap = lambda x: temps.get(id(x), x)  # noqa: E731
    new_args, new_kwargs = tree_map(swap, args), tree_map(swap, kwargs)
    _dispatch(func, new_args, new_kwargs, [temps.get(id(g), g) for g in grads])
    with torch.no_grad():
        for i, g in targets.items():
            if g.n:
                g.unit.load_segment(g.lo + g.unit.owned[0], temps[i].local)
            params_written(g.unit)  # (every rank, owner or not)
    return args[0]


# -- dispatch -----------------------------------------------------------------------------------
def _dispatch(func: Any, args: tuple, kwargs: dict, grads: list[ShardedTensor]) -> Any:
    if func in _ALIASES:  # (detach: what state_dict() returns; a piece, not a Parameter)
        g = args[0]
        return ShardedTensor(g.store, g.lo, g.n, g.shape, g.dtype, g.device, g.start, g.comm, g.unit,
                             whole=g.whole, part=g.part)
    if not any(g.sharded for g in grads):  # whole gradients: the op runs on them as they are
        out = func(*_sub(args, _whole), **_sub(kwargs, _whole))
        _note_writes(func, grads)
        return out
    packet = func.overloadpacket
    if packet in _REDUCTIONS and _is_full_reduction(func, args, kwargs):
        return _REDUCTIONS[packet](*args, **kwargs)
    if func is aten._foreach_norm.Scalar:
        return [_norm(g, args[1] if len(args) > 1 else 2) for g in args[0]]
    if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
        func(*_sub(args, lambda g: g.local), **_sub(kwargs, lambda g: g.local))
        args[1].copy_(_agree(grads[0], args[1], dist.ReduceOp.MAX))
        _note_writes(func, grads)
        return None
    layout = _same_layout(grads)
    if layout is not None and _pointwise_ok(func, args, kwargs, layout):
        return _pointwise(func, args, kwargs, layout, grads)
    return _gathered(func, args, kwargs, grads)


def _pointwise(func: Any, args: tuple, kwargs: dict, layout: ShardedTensor, grads: list) -> Any:
    def local(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            return x.local
        if isinstance(x, torch.Tensor) and x.shape == layout.shape and x.dim() > 0:
            return x.reshape(-1)[layout.start:layout.start + layout.n]
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            return x.to(layout.local.device)
        return x
    out = func(*tree_map(local, args), **tree_map(local, kwargs))
    _note_writes(func, grads)
    if _mutates(func):
        return args[0]
    if isinstance(out, torch.Tensor):
        dtype = layout.dtype if out.dtype == layout.local.dtype else out.dtype
        return layout.like(out, dtype)
    return out


def _gathered(func: Any, args: tuple, kwargs: dict, grads: list[ShardedTensor]) -> Any:
    name = str(func)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"zeroshard: {name} on a sharded gradient (stages 2-3) gathers the parameter's "
                      "whole gradient from all ranks to compute it; every rank must make the same call",
                      stacklevel=3)
    full = {id(g): g.full() for g in grads}
    swap = lambda x: full[id(x)] if isinstance(x, ShardedTensor) else x  # noqa: E731
    out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
    if _mutates(func):  # an in-place op changed the gathered copies: keep this rank's pieces
        for g in grads:
            g.local.copy_(full[id(g)].reshape(-1)[g.start:g.start + g.n])
    _note_writes(func, grads)
    if _mutates(func) and args and isinstance(args[0], ShardedTensor):
        return args[0]
    return out


# -- reductions ---------------------------------------------------------------------------------
def _norm(g: ShardedTensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> torch.Tensor:
    ord = float(2 if ord is None else ord)
    x = g.local
    if x.is_complex():  # (the norm of the moduli, as torch's; Note [complex parameters])
        x = torch.view_as_real(x) if ord == 2.0 else x.abs()
    if ord == math.inf:
        part, op = (x.abs().max() if x.numel() else x.new_zeros(())), dist.ReduceOp.MAX
    elif ord == -math.inf:
        part, op = (x.abs().min() if x.numel() else x.new_full((), math.inf)), dist.ReduceOp.MIN
    elif ord == 0:
        part, op = (x != 0).sum().to(torch.float64), dist.ReduceOp.SUM
    elif ord == 2.0:
        part, op = squared_norm_f64(x), dist.ReduceOp.SUM
    else:
        part, op = torch.linalg.vector_norm(x, ord, dtype=torch.float64) ** ord, dist.ReduceOp.SUM
    total = _agree(g, part, op)
    if ord not in (0.0, math.inf, -math.inf):
        total = total ** (1.0 / ord)
    return total.to(dtype or real_dtype(g.dtype))


def _norm_op(g: ShardedTensor, p: Any = 2, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> torch.Tensor:
    return _norm(g, p, dim, keepdim, dtype)


def _sum(g: ShardedTensor, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> torch.Tensor:
    return _agree(g, g.local.sum(dtype=torch.float64), dist.ReduceOp.SUM).to(dtype or g.dtype)


def _mean(g: ShardedTensor, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> torch.Tensor:
    return (_sum(g, dtype=torch.float64) / math.prod(g.shape)).to(dtype or g.dtype)


def _extreme(op: Any, empty: float) -> Any:
    def reduce(g: ShardedTensor, *rest: Any, **kw: Any) -> torch.Tensor:
        x = g.local
        part = (x.max() if op is dist.ReduceOp.MAX else x.min()) if x.numel() else x.new_full((), empty)
        return _agree(g, part, op).to(g.dtype)
    return reduce


def _logical(op: Any) -> Any:
    def reduce(g: ShardedTensor, *rest: Any, **kw: Any) -> torch.Tensor:
        x = g.local
        part = (x.all() if op is dist.ReduceOp.MIN else x.any()).to(torch.int32)
        return _agree(g, part, op).to(torch.bool)
    return reduce


_REDUCTIONS = {
    aten.linalg_vector_norm: _norm, aten.norm: _norm_op, aten.sum: _sum, aten.mean: _mean,
    aten.max: _extreme(dist.ReduceOp.MAX, -math.inf), aten.amax: _extreme(dist.ReduceOp.MAX, -math.inf),
    aten.min: _extreme(dist.ReduceOp.MIN, math.inf), aten.amin: _extreme(dist.ReduceOp.MIN, math.inf),
    aten.all: _logical(dist.ReduceOp.MIN), aten.any: _logical(dist.ReduceOp.MAX),
}


def _is_full_reduction(func: Any, args: tuple, kwargs: dict) -> bool:
    """The op reduces every element of a sharded gradient to one value (no ``dim``, or all)."""
    if not (args and isinstance(args[0], ShardedTensor)):
        return False
    names = [a.name for a in func._schema.arguments]
    if "out" in names or len(func._schema.returns) != 1:
        return False
    dim = kwargs.get("dim", args[names.index("dim")] if "dim" in names and names.index("dim") < len(args) else None)
    if dim is None or dim == []:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % max(1, args[0].dim()) for d in dims) == list(range(args[0].dim())) and not kwargs.get("keepdim")


def _agree(g: ShardedTensor, value: torch.Tensor, op: Any) -> torch.Tensor:
    """``value`` reduced with ``op`` over the ranks that hold pieces of ``g``."""
    comm = _need_comm(g)
    t = value.detach().clone().reshape(1)
    comm.all_reduce(t, op=op, what="sharded_reduction")
    return t.reshape(())


# -- helpers ------------------------------------------------------------------------------------
def _flat(args: tuple, kwargs: dict) -> list:
    out: list = []
    tree_map(out.append, (args, kwargs))
    return out


def _sub(tree: Any, fn: Any) -> Any:
    return tree_map(lambda x: fn(x) if isinstance(x, ShardedTensor) else x, tree)


def _whole(g: ShardedTensor) -> torch.Tensor:
    return g.local.view(g.shape)


def _mutates(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _same_layout(grads: list[ShardedTensor]) -> Optional[ShardedTensor]:
    first = grads[0]
    for g in grads[1:]:
        if g.shape != first.shape or g.start != first.start or g.n != first.n:
            return None
    return first


def _pointwise_ok(func: Any, args: tuple, kwargs: dict, layout: ShardedTensor) -> bool:
    if _mutates(func) and not isinstance(args[0], ShardedTensor):  # a full tensor is written
        return False
    if torch.Tag.pointwise not in func.tags and func.overloadpacket not in (aten.zero_, aten.copy_, aten.fill_,
                                                                             aten.clone):
        return False
    for x in _flat(args, kwargs):  # other tensors must be 0-dim or of the gradient's shape
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor) and x.dim() > 0 and x.shape != layout.shape:
            return False
    return True


def _note_writes(func: Any, grads: list[ShardedTensor]) -> None:
    """A swapped gradient's noted norm and finiteness (clipping reads those) are out of date
    after an in-place op; they are noted again once per unit, as it leaves memory (Note
    [parts held for torch code] in zeroshard/offload/unit_swap.py), not once per parameter."""
    if _mutates(func):
        for g in grads:
            if g.part == "grad" and g.unit is not None and g.unit.swap is not None:
                g.unit.grad_stats = None


class _resident:
    """Swapped parts (NVMe offload) are read in for the op and held (``NvmeUnitStore.touched``)."""

    def __init__(self, grads: list[ShardedTensor], write: bool) -> None:
        self.ctxs = []
        seen: set[tuple[int, str]] = set()
        for g in grads:
            u = g.unit
            if u is not None:  # (a step still updating the unit in the background finishes it first)
                u.await_step()
            if u is not None and u.swap is not None and u.swapped(g.part) and (id(u), g.part) not in seen:
                seen.add((id(u), g.part))
                self.ctxs.append(u.swap.touched(u, g.part, write))

    def __enter__(self) -> None:
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
