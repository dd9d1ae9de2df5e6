"""Frozen weights in checkpoints: recorded by digest, saved only on request.

Note [frozen weights in checkpoints]: a LoRA fine-tune of a 7B model trains a few million
parameters on a frozen base of billions. Saving the base at every step would make each
checkpoint the size of the model, so by default a step saves what trains (adapters, their
optimizer state, scheduler, data position, RNG) and the manifest's ``frozen`` entry records
which base it expects: every frozen parameter's name, shape, dtype and a digest of its
values. Resuming recomputes the digests of the model it loads into and refuses, naming the
tensors, when the base differs (another model, another revision, a base that was modified).
``save_checkpoint(..., save_frozen=True)`` writes frozen weights too (each rank its pieces
at stage 3, rank 0 the whole tensors below it); a checkpoint that holds them restores them.

The digest must not depend on how the weights are partitioned (a checkpoint saved at world 2
resumes at world 4) and must cost about a read of the base: each tensor is cut into fixed
blocks of ``_BLOCK`` elements, each block's bytes get a CRC32 (zlib: ~1 ns per bf16 element,
50x a vectorised per-element hash), and the digest is the sum over blocks of a mix of
(block index, CRC) modulo a prime. The rank holding a whole block CRCs it; a block that
straddles two ranks' ranges is put together from the pieces every rank contributes (at most
two per segment and rank, so a few MiB) and CRCed by all. It detects accidents, not
tampering (as the CRC32 of the data files).
"""
from __future__ import annotations

import contextlib
import ctypes
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zeroshard.checkpoint.errors import CheckpointMismatchError
from zeroshard.checkpoint.pieces import PARAM, PieceRecord, _deferred
from zeroshard.checkpoint.shard_file import CODES

_PRIME = (1 << 61) - 1
_MASK = (1 << 64) - 1
_BLOCK = 1 << 16  # elements per CRC'd block of a tensor
METHOD = "crc32-blocks-65536"


@dataclass(frozen=True)
class FrozenRun:
    """A frozen unit where the loader expects a run of the optimizer (only ``unit`` is read)."""

    unit: Any


def _managed_frozen(opt: Any) -> list[Any]:
    return list(getattr(opt, "frozen_units", []) or []) if opt is not None else []


def managed_ids(opt: Any) -> set[int]:
    """ids of the tensors stage 3 shows for frozen parameters kept in frozen units."""
    out: set[int] = set()
    for u in _managed_frozen(opt):
        for m in u.members:
            out.add(id(m.param))
            if opt.gatherer is not None:
                out.add(id(opt.gatherer.visible(m.param)))
    return out


def whole_frozen(model: Optional[nn.Module], opt: Any) -> dict[str, torch.Tensor]:
    """Frozen parameters held whole (stages 0-2, or a model without optimizer), by state_dict
    name, tied ones once."""
    if model is None:
        return {}
    skip = managed_ids(opt)
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or id(t) in skip:
            continue
        seen.add(id(t))
        if isinstance(t, nn.Parameter) and not t.requires_grad and t.is_floating_point():
            out[name] = t.detach()
    return out


def unit_segments(opt: Any) -> Iterator[tuple[Any, Any]]:
    for u in _managed_frozen(opt):
        for seg in u.layout.segments:
            yield u, seg


def _raw(values: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, read in place. (Not ``.numpy()``: a tensor that shares memory
    with numpy can no longer have its storage resized, which released units need.)"""
    t = values.detach().contiguous()
    if t.device.type != "cpu":  # (a device shard: hashed from a host copy)
        t = t.cpu()
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())) if n else memoryview(b"")


def _crc(values: torch.Tensor) -> int:
    return zlib.crc32(_raw(values))


def _mix(block: int, crc: int) -> int:
    return (((crc + 1) * 0x9E3779B97F4A7C15) ^ (block * 0xC2B2AE3D27D4EB4F)) & _MASK


def _blocks(values: torch.Tensor, start: int, numel: int) -> tuple[int, list[tuple[int, int, bytes]]]:
    """(sum of mixed CRCs of the whole blocks inside ``values`` = elements [start, start + n) of
    a tensor of ``numel``, pieces (block, offset in block, bytes) of the blocks it holds a part of)."""
    n = values.numel()
    flat = values.detach().reshape(-1)
    total, pieces = 0, []
    k = start // _BLOCK
    while k * _BLOCK < start + n:
        a, b = max(start, k * _BLOCK), min(start + n, (k + 1) * _BLOCK, numel)
        part = flat[a - start:b - start]
        if a == k * _BLOCK and b == min((k + 1) * _BLOCK, numel):
            total += _mix(k, _crc(part))
        else:
            pieces.append((k, a - k * _BLOCK, bytes(_raw(part))))
        k += 1
    return total % _PRIME, pieces


def digests(model: Optional[nn.Module], opt: Any) -> dict[str, dict]:
    """name -> {shape, dtype, digest} of every frozen parameter (a collective at stage 3:
    each rank hashes what it owns; the partial sums are gathered). Cached on the optimizer
    until a frozen weight is written (a tensor's version counter, a frozen unit's writes)."""
    whole = whole_frozen(model, opt)
    key = (tuple((n, t.data_ptr(), t._version) for n, t in whole.items()),
           tuple(u.writes for u in _managed_frozen(opt)))
    cached = getattr(opt, "_frozen_digests", None) if opt is not None else None
    if cached is not None and cached[0] == key:
        return cached[1]
    result = _digests(whole, opt)
    if opt is not None:
        opt._frozen_digests = (key, result)
    return result


def _digests(whole: dict[str, torch.Tensor], opt: Any) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, t in whole.items():
        out[name] = {"shape": list(t.shape), "dtype": CODES[t.dtype], "sum": _blocks(t, 0, t.numel())[0]}
    segments = list(unit_segments(opt))
    if segments:
        partial: dict[str, int] = {}
        pieces: dict[str, list] = {}
        for u in _managed_frozen(opt):
            lo, hi = u.owned
            with (u.swap.resident(u, ("shard",)) if u.swapped("shard") else contextlib.nullcontext()):
                for seg in u.layout.segments:
                    a, b = max(lo, seg.offset), min(hi, seg.end)
                    if a < b:
                        partial[seg.name], pieces[seg.name] = _blocks(u.shard[a - lo:b - lo], a - seg.offset,
                                                                      seg.numel)
        gathered = opt.comm.all_gather_object((partial, pieces)) if opt.comm.world_size > 1 else [(partial, pieces)]
        for u, seg in segments:
            total = sum(p.get(seg.name, 0) for p, _ in gathered)
            straddling: dict[int, list] = {}
            for _, ps in gathered:
                for k, off, data in ps.get(seg.name, ()):
                    straddling.setdefault(k, []).append((off, data))
            for k, parts in straddling.items():  # every rank CRCs the same assembled block
                total += _mix(k, zlib.crc32(b"".join(d for _, d in sorted(parts))))
            out[seg.name] = {"shape": list(seg.shape), "dtype": CODES[u.dtype], "sum": total % _PRIME}
    return {n: {"shape": e["shape"], "dtype": e["dtype"], "digest": f"{e['sum']:016x}"} for n, e in out.items()}


def base_record(model: Optional[nn.Module], opt: Any, saved: bool) -> dict:
    """The manifest's ``frozen`` entry."""
    return {"saved": saved, "method": METHOD, "tensors": digests(model, opt)}


def frozen_pieces(opt: Any) -> list[PieceRecord]:
    """This rank's pieces of the frozen units (``save_frozen=True`` at stage 3)."""
    records = []
    for u in _managed_frozen(opt):
        lo, hi = u.owned
        for piece in u.layout.pieces_in(lo, hi):
            ua, ub = piece.unit_offset, piece.unit_offset + piece.numel
            rec = PieceRecord(piece.segment.name, piece.start, piece.stop)
            rec.tensors[PARAM] = (_deferred(u.dtype, u.swap.read_range, u, "shard", ua, ub)
                                  if u.swapped("shard") else u.param_range(ua, ub))
            records.append(rec)
    return records


def frozen_needed(opt: Any, saved: set[str]) -> Iterator[tuple[str, int, int, FrozenRun, Any, None]]:
    """(name, [a, b), where it goes, piece, no tensor-parallel split) of the frozen-unit pieces this rank loads from a
    checkpoint that holds them (saved with ``save_frozen=True``, or before frozen units)."""
    for u in _managed_frozen(opt):
        lo, hi = u.owned
        for piece in u.layout.pieces_in(lo, hi):
            if piece.segment.name in saved:
                yield piece.segment.name, piece.start, piece.stop, FrozenRun(u), piece, None


def check_base(record: Any, names: list[str], model: Optional[nn.Module], opt: Any, where: str) -> None:
    """Frozen parameters a checkpoint did not save must be the ones it was trained on."""
    if not names:
        return
    if record.get("method", METHOD) != METHOD:
        raise CheckpointMismatchError(f"{where} records its base by digest method {record.get('method')!r}; this "
                                      f"zeroshard computes {METHOD!r} and cannot check the base it expects")
    mine = digests(model, opt)
    wrong = []
    for n in names:
        want, have = record["tensors"][n], mine.get(n)
        if have is None:
            continue  # (not frozen here: reported as missing by the caller)
        if want.get("shape") != have["shape"] or want.get("dtype") != have["dtype"]:
            wrong.append(f"{n}: checkpoint {want.get('dtype')}{want.get('shape')} vs model "
                         f"{have['dtype']}{have['shape']}")
        elif want.get("digest") != have["digest"]:
            wrong.append(f"{n}: values differ (digest {want.get('digest')} vs {have['digest']})")
    if wrong:
        raise CheckpointMismatchError(
            f"{where} was trained on another base model: {len(wrong)} of {len(names)} frozen weights it "
            f"expects differ ({'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}). Load the base it was "
            "trained from before resuming (the checkpoint holds only what trains; save_frozen=True keeps the "
            "base too)")
