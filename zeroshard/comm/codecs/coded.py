"""Quantized collectives: all-gather, reduce-scatter and all-reduce of encoded buffers.

Note [quantized collectives]: a codec (Note [codec error bounds] in formats.py) changes what a
collective moves, never which ranks take part or in what order, so every rank still issues the
same collectives in the same order. ``Comm.gather_shards`` / ``reduce_for_shard`` / the
reducer's all-reduces take a ``LinkCodecs`` and ask it for the codec of their group's dimension
(``codec_links="inter_node"`` quantizes only groups that cross nodes); None means the old
full-precision path, unchanged bit for bit.

- all-gather (qwZ): each rank encodes its slice, the encoded slices are all-gathered, and every
  rank decodes every slice, its own included, so all ranks compute with the same weights (the
  shard itself, what the optimizer updates, stays exact).
- reduce-scatter (qgZ): torch.distributed has no reduction over encoded values (gloo none at
  all), so as in ZeRO++ each rank encodes each destination's chunk of its contribution, one
  all-to-all delivers chunk r of every rank to rank r, which decodes them and sums in fp32 in
  rank order (the same order on every rank: deterministic).
- all-reduce (stages 0-1, a hybrid mesh's replicas): that reduce-scatter over chunks padded to
  a multiple of the group size, then the summed chunks encoded again and all-gathered; every
  rank decodes the same bytes, so replicas stay identical. With error feedback the owner of a
  chunk carries what encoding its sum lost as well (a second residual, 1/group of the first).

Bytes are counted in ``Comm.traffic`` as the logical size of the encoded buffers (the whole
gathered or all-to-all buffer, as for the full-precision collectives) under the kind and codec,
e.g. ``all_gather[int8]``, so ``comm_report`` gives bytes per link per codec.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from zeroshard.comm.codecs.codec_formats import Codec
from zeroshard.comm.collective_names import all_gather_single

if TYPE_CHECKING:
    from zeroshard.comm.codecs.link_codecs import LinkCodecs


class Group(Protocol):
    """What a quantized collective needs of ``Comm`` (zeroshard/comm/process_group.py)."""
    rank: int
    world_size: int
    dimension: str
    group: Optional[dist.ProcessGroup]

    def _count(self, kind: str, nbytes: int) -> None: ...


class _Finish:
    """A started collective and what completes it once it has arrived (decoding)."""

    def __init__(self, work: Optional[dist.Work], finish: Callable[[], None]) -> None:
        self.work, self.finish, self.done = work, finish, False

    def wait(self) -> bool:
        if not self.done:
            if self.work is not None:
                self.work.wait()
            self.done = True
            self.finish()
        return True


def _encode_chunks(codec: Codec, x: torch.Tensor, parts: int, residual: Optional[torch.Tensor],
                   codecs: "LinkCodecs", dimension: str) -> torch.Tensor:
    """``x`` (fp32, ``parts`` equal chunks) encoded chunk by chunk into one buffer; the residual
    updated (Note [gradient error feedback]) and the error recorded."""
    n = x.numel() // parts
    eb = codec.encoded_bytes(n)
    send = torch.empty(parts * eb, dtype=torch.uint8, device=x.device)
    if residual is not None:
        x = x + residual
    back = torch.empty(n, dtype=torch.float32, device=x.device)
    worst = 0.0
    for i in range(parts):
        chunk = x[i * n:(i + 1) * n]
        codec.encode(chunk, send[i * eb:(i + 1) * eb])
        codec.decode(send[i * eb:(i + 1) * eb], back)
        err = chunk - back
        worst = max(worst, float(err.abs().max())) if n else worst
        if residual is not None:
            residual[i * n:(i + 1) * n].copy_(err)
    codecs.record("grads", dimension, worst)
    _keep_finite(residual)
    return send


def _keep_finite(residual: Optional[torch.Tensor]) -> None:
    """An overflowing step (fp16: skipped by the loss scaler) leaves inf/NaN in its residual;
    carried on, it would make every later step overflow too. It restarts at zero instead."""
    if residual is not None and not bool(torch.isfinite(residual).all()):
        residual.zero_()


def gather(comm: Group, full: torch.Tensor, codec: Codec, codecs: "LinkCodecs", what: str = "weights",
           kind: str = "all_gather", residual: Optional[torch.Tensor] = None) -> _Finish:
    """In-place all-gather of ``full``'s equal slices (this rank's is slice ``comm.rank``) through ``codec``."""
    w = comm.world_size
    n = full.numel() // w
    eb = codec.encoded_bytes(n)
    mine = full[comm.rank * n:(comm.rank + 1) * n]
    send = torch.empty(eb, dtype=torch.uint8, device=full.device)
    if residual is None:
        codec.encode(mine, send)
    else:  # (an all-reduce's sums: Note [gradient error feedback])
        x = mine.float() + residual
        codec.encode(x, send)
        back = torch.empty_like(x)
        codec.decode(send, back)
        residual.copy_(x - back)
        _keep_finite(residual)
    recv = torch.empty(w * eb, dtype=torch.uint8, device=full.device)
    comm._count(f"{kind}[{codec.name}]", w * eb)
    work = all_gather_single(recv, send, group=comm.group, async_op=True)

    def finish() -> None:
        before = mine.to(torch.float32, copy=True)
        for i in range(w):
            codec.decode(recv[i * eb:(i + 1) * eb], full[i * n:(i + 1) * n])
        codecs.record(what, comm.dimension, float((mine.float() - before).abs().max()) if n else 0.0)
    return _Finish(work, finish)


def reduce_scatter(comm: Group, full: torch.Tensor, out: torch.Tensor, codec: Codec, codecs: "LinkCodecs",
                   key: Optional[str], kind: str = "reduce_scatter") -> _Finish:
    """Sum of every rank's ``full`` (equal chunks, one per rank) into ``out`` (rank ``comm.rank``'s
    chunk) through ``codec``: an all-to-all of encoded chunks, decoded and summed in fp32."""
    w = comm.world_size
    n = full.numel() // w
    residual = codecs.residual(None if key is None else f"{key}@{comm.dimension}", full.numel(), full.device)
    send = _encode_chunks(codec, full.float(), w, residual, codecs, comm.dimension)
    eb = send.numel() // w
    recv = torch.empty_like(send)
    comm._count(f"{kind}[{codec.name}]", send.numel())
    work = dist.all_to_all_single(recv, send, group=comm.group, async_op=True)

    def finish() -> None:
        acc = torch.zeros(n, dtype=torch.float32, device=full.device)
        part = torch.empty(n, dtype=torch.float32, device=full.device)
        for i in range(w):  # (rank order on every rank)
            codec.decode(recv[i * eb:(i + 1) * eb], part)
            acc += part
        out.copy_(acc)
    return _Finish(work, finish)


def all_reduce(comm: Group, tensor: torch.Tensor, codec: Codec, codecs: "LinkCodecs", key: Optional[str]) -> _Finish:
    """Sum of every rank's ``tensor`` into it, through ``codec``: a quantized reduce-scatter of
    chunks padded to a multiple of the group size, then a quantized all-gather of the sums."""
    w = comm.world_size
    numel = tensor.numel()
    n = math.ceil(numel / w)
    padded = torch.zeros(n * w, dtype=torch.float32, device=tensor.device)
    padded[:numel].copy_(tensor.reshape(-1))
    reduce_scatter(comm, padded, padded[comm.rank * n:(comm.rank + 1) * n], codec, codecs, key, "all_reduce").wait()
    summed = codecs.residual(None if key is None else f"{key}@{comm.dimension}/sum", n, tensor.device)
    ag = gather(comm, padded, codec, codecs, what="grads", kind="all_reduce", residual=summed)

    def finish() -> None:
        ag.finish()
        tensor.copy_(padded[:numel].view_as(tensor))
    return _Finish(ag.work, finish)
