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
resumes at world 4), so it is a sum over elements of a mixed hash of (element index, bit
pattern), taken modulo a prime: each rank sums the elements it owns, the partial sums add up.
It detects accidents, not tampering (as the CRC32 of the data files).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zeroshard.checkpoint.errors import CheckpointMismatchError
from zeroshard.checkpoint.pieces import PARAM, PieceRecord, _deferred
from zeroshard.checkpoint.shard_file import CODES

_PRIME = (1 << 61) - 1
_CHUNK = 1 << 20  # elements hashed at once (bounds the int64 temporaries to ~40 MiB)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def _hash_sum(values: torch.Tensor, start: int) -> int:
    """Sum over the elements of a hash of (global index, bit pattern), as a Python int."""
    flat = values.detach().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
    total = 0
    for a in range(0, flat.numel(), _CHUNK):
        b = bits[a:a + _CHUNK].to(torch.int64)
        idx = torch.arange(start + a, start + a + b.numel(), dtype=torch.int64)
        h = (b + 0x9E3779B1) * 0x85EBCA77 + idx * 0xC2B2AE3D
        h = h ^ (h >> 29)
        h = h * 0x27D4EB2F
        h = h ^ (h >> 32)
        total += int((h & 0x7FFFFFFF).sum())
    return total % _PRIME


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
        out[name] = {"shape": list(t.shape), "dtype": CODES[t.dtype], "sum": _hash_sum(t, 0)}
    segments = list(unit_segments(opt))
    if segments:
        partial: dict[str, int] = {}
        for u in _managed_frozen(opt):
            lo, hi = u.owned
            with (u.swap.resident(u, ("shard",)) if u.swapped("shard") else contextlib.nullcontext()):
                for seg in u.layout.segments:
                    a, b = max(lo, seg.offset), min(hi, seg.end)
                    partial[seg.name] = _hash_sum(u.shard[a - lo:b - lo], a - seg.offset) if a < b else 0
        sums = opt.comm.all_gather_object(partial) if opt.comm.world_size > 1 else [partial]
        for u, seg in segments:
            out[seg.name] = {"shape": list(seg.shape), "dtype": CODES[u.dtype],
                             "sum": sum(s.get(seg.name, 0) for s in sums) % _PRIME}
    return {n: {"shape": e["shape"], "dtype": e["dtype"], "digest": f"{e['sum']:016x}"} for n, e in out.items()}


def base_record(model: Optional[nn.Module], opt: Any, saved: bool) -> dict:
    """The manifest's ``frozen`` entry."""
    return {"saved": saved, "tensors": digests(model, opt)}


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
