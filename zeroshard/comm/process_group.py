"""A thin view of the data-parallel process group, with collectives chosen per backend.

zeroshard never builds its own transport: every byte moves through torch.distributed.
What this wrapper adds is the choice of *which* collective expresses an operation, since
backends differ. Measured on gloo (``benchmarks/bench_collectives.py``, 100 MB fp32, 2 and
4 ranks): ``reduce_scatter_tensor`` costs 1.8-2.0x an ``all_reduce`` of the same bytes, so a
gradient reduce-scatter is an all-reduce whose slice is kept; ``all_gather_into_tensor``
costs 1.6x an all-reduce, while one ``broadcast`` per owner (each rank sends its slice) costs
0.4-0.6x, so a parameter all-gather is W broadcasts. NCCL keeps the natural collectives.
``benchmarks/bench_collectives.py`` re-measures the choice; ZEROSHARD_COLLECTIVES=native or
=emulated forces one for experiments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Union

import torch
import torch.distributed as dist

from zeroshard.comm.collective_names import all_gather_single, reduce_scatter_single
from zeroshard.comm.clean_exit import watch  # (Note [clean exit]: groups destroyed at exit)
from zeroshard.comm.codecs import coded

if TYPE_CHECKING:
    from zeroshard.comm.codecs.link_codecs import LinkCodecs


class Work(Protocol):
    def wait(self) -> bool: ...


class _Done:
    """A completed operation, for world size 1 where nothing needs to move."""

    def wait(self) -> bool:
        return True


class _AllOf:
    """Several operations completing as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


@dataclass
class Traffic:
    """What one kind of collective moved on this rank: calls, and bytes of the tensors each
    rank contributed (the logical operation's size; an emulated all-gather counts once, not
    per broadcast). ``dimension`` names the process group it crossed ("dp": the data-parallel
    group; a hybrid mesh adds its own dimensions)."""

    calls: int = 0
    bytes: int = 0
    dimension: str = "dp"


def check_launched_with_group() -> None:
    """A launcher (torchrun, ``accelerate launch``) that says there are several ranks
    (``WORLD_SIZE`` > 1) needs ``init_process_group`` before the optimizer: without a group each
    rank would silently train alone as a world of one, on its own data."""
    if dist.is_available() and dist.is_initialized():
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:  # (not a launcher's value: torch.distributed would refuse it itself)
        return
    if world > 1:
        raise RuntimeError(
            f"the environment says WORLD_SIZE={world} (as torchrun sets it) but no process group is "
            "initialized, so each rank would train alone as a world of one. Call "
            "torch.distributed.init_process_group(backend) before building the ZeroOptimizer (or unset "
            "WORLD_SIZE for a single process)")


class Comm:
    """Rank, world size and collectives of one process group (or of a single process).

    Every collective is counted in ``traffic`` (by kind) so the communication a configuration
    costs is measured, not asserted (``ZeroOptimizer.comm_report``). A world of one process
    moves nothing and counts nothing."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, dimension: str = "dp") -> None:
        self.dimension = dimension
        self.traffic: dict[str, Traffic] = {}
        initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialized:
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) first (or pass process_group=None "
                "for a single process)")
        self.group = process_group if process_group is not None else (dist.group.WORLD if initialized else None)
        if self.group is None:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        else:
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.backend = str(dist.get_backend(self.group))
            watch(self)
        forced = os.environ.get("ZEROSHARD_COLLECTIVES", "")
        if forced not in ("", "native", "emulated"):
            raise ValueError(f"ZEROSHARD_COLLECTIVES={forced!r}; use 'native' or 'emulated'")
        self.emulate_collectives = forced == "emulated" or (forced == "" and self.backend == "gloo")

    def _global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (collectives between ranks: a group exists)."""
        if self.group is None:
            raise RuntimeError(f"rank {group_rank} of a world of one process: there is no process group to "
                               "translate it in (a collective ran with world_size == 1)")
        return dist.get_global_rank(self.group, group_rank)

    def _count(self, kind: str, nbytes: int) -> None:
        t = self.traffic.get(kind)
        if t is None:
            t = self.traffic[kind] = Traffic(dimension=self.dimension)
        t.calls += 1
        t.bytes += nbytes

    @property
    def shard_rank(self) -> int:
        """Which equal slice of a unit this rank owns: its group rank, except under hpZ
        (Note [hpZ slice order] in zeroshard/comm/hierarchical.py)."""
        return self.rank

    # -- plain collectives ---------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Union[dist.ReduceOp, dist.ReduceOp.RedOpType] = dist.ReduceOp.SUM,
                   async_op: bool = False, what: str = "all_reduce") -> Work:
        """``what`` names the traffic in ``traffic`` (small control reductions — norms, flags —
        are counted apart from the gradients')."""
        if self.world_size == 1:
            return _Done()
        self._count(what, _nbytes(tensor))
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def any_true(self, flag: bool) -> bool:
        """True on every rank when the flag is true on at least one rank."""
        t = torch.tensor([1.0 if flag else 0.0])
        self.all_reduce(t, op=dist.ReduceOp.MAX, what="flag")
        return bool(t.item() > 0)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if self.world_size == 1:
            return obj
        self._count("broadcast_object", 0)
        box = [obj]
        dist.broadcast_object_list(box, src=self._global_rank(src), group=self.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list:
        if self.world_size == 1:
            return [obj]
        self._count("all_gather_object", 0)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0,
                          bucket_bytes: int = 16 * 2**20) -> None:
        """Every rank's ``tensors`` take rank ``src``'s values (meta tensors, which hold none,
        are skipped); coalesced per dtype into buckets of about ``bucket_bytes``."""
        if self.world_size == 1:
            return
        seen: set[int] = set()
        live: list[torch.Tensor] = []
        for t in tensors:
            if not t.is_meta and t.numel() and id(t) not in seen:
                seen.add(id(t))
                live.append(t)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in live:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        root = self._global_rank(src)
        for group in by_kind.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for item in [*group, None]:
                if item is not None:
                    bucket.append(item)
                    size += item.numel() * item.element_size()
                if bucket and (item is None or size >= bucket_bytes):
                    flat = torch.cat([b.detach().reshape(-1) for b in bucket])
                    self._count("broadcast", _nbytes(flat))
                    dist.broadcast(flat, src=root, group=self.group)
                    with torch.no_grad():
                        for b, v in zip(bucket, flat.split([b.numel() for b in bucket])):
                            b.copy_(v.view_as(b))
                    bucket, size = [], 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    # -- ZeRO building blocks ------------------------------------------------------------
    def all_reduce_coded(self, tensor: torch.Tensor, codecs: Optional["LinkCodecs"], key: Optional[str] = None,
                         async_op: bool = False) -> Work:
        """``all_reduce`` (a sum) through the gradient codec of this group's link, if any (Note
        [quantized collectives]); ``key`` names the residual of error feedback."""
        codec = codecs.grads(self.dimension) if codecs is not None and self.world_size > 1 else None
        if codec is None or codecs is None:
            return self.all_reduce(tensor, async_op=async_op)
        work = coded.all_reduce(self, tensor, codec, codecs, key)
        if not async_op:
            work.wait()
        return work

    def reduce_for_shard(self, full: torch.Tensor, shard_out: Optional[torch.Tensor],
                         codecs: Optional["LinkCodecs"] = None, key: Optional[str] = None) -> Work:
        """Start summing ``full`` across ranks so this rank can read its equal slice.

        With the all-reduce emulation the sum lands in ``full`` (read the slice from there);
        otherwise it lands in ``shard_out``. ``result_in_full`` says which applies. ``codecs``:
        through the gradient codec of this link, if any (Note [quantized collectives]).
        """
        if self.world_size == 1:
            if shard_out is not None and not self.result_in_full:
                shard_out.copy_(full)
            return _Done()
        codec = codecs.grads(self.dimension) if codecs is not None else None
        if codec is not None and codecs is not None:
            n = full.numel() // self.world_size
            out = full[self.rank * n:(self.rank + 1) * n] if shard_out is None or self.result_in_full else shard_out
            return coded.reduce_scatter(self, full, out, codec, codecs, key)
        self._count("reduce_scatter", _nbytes(full))
        if self.result_in_full:
            return dist.all_reduce(full, group=self.group, async_op=True)
        if shard_out is None:
            raise RuntimeError("reduce_scatter: shard_out is None, but the result does not land in full here")
        return reduce_scatter_single(shard_out, full, group=self.group, async_op=True)

    @property
    def result_in_full(self) -> bool:
        return self.world_size == 1 or self.emulate_collectives

    def gather_shards(self, full: torch.Tensor, codecs: Optional["LinkCodecs"] = None) -> Work:
        """Start an in-place all-gather: on entry each rank's own equal slice of ``full``
        holds its data; on completion every slice does, on every rank. ``codecs``: parameters
        through the weight codec of this link, if any (Note [quantized collectives])."""
        if self.world_size == 1:
            return _Done()
        codec = codecs.weights(self.dimension) if codecs is not None else None
        if codec is not None and codecs is not None:
            return coded.gather(self, full, codec, codecs)
        self._count("all_gather", _nbytes(full))
        n = full.numel() // self.world_size
        lo, hi = self.rank * n, (self.rank + 1) * n
        if self.emulate_collectives:
            return _AllOf([dist.broadcast(full[i * n:(i + 1) * n], src=self._global_rank(i),
                                          group=self.group, async_op=True) for i in range(self.world_size)])
        return all_gather_single(full, full[lo:hi], group=self.group, async_op=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
