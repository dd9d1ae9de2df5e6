"""Frozen weights in checkpoints: recorded by digest, left out for a PEFT model's base.

Note [frozen weights in checkpoints]: a LoRA fine-tune of a 7B model trains a few million
parameters on a frozen base of billions. Saving the base at every step would make each
checkpoint the size of the model, so for a PEFT model (a ``PeftModel``, or PEFT adapter
layers in the model) a step saves by default what trains (adapters, their optimizer state,
scheduler, data position, RNG) and the manifest's ``frozen`` entry records which base it
expects: every frozen parameter's name, shape, dtype and a digest of its values. Resuming
recomputes the digests of the model it loads into and refuses, naming the tensors, when the
base differs (another model, another revision, a base that was modified), lacks one of them
or trains it; ``export_hf(..., base=DIR)`` fills the base in from its Hugging Face directory,
checked against the same digests. Any other model's frozen weights (a frozen embedding, a
frozen tower) are part of what it is, so its checkpoints are whole by default: they export
and resume into a freshly initialised model. ``save_frozen=True``/``False`` chooses either way
(each rank writes its pieces at stage 3, rank 0 the whole tensors below it); a checkpoint
that holds them restores them.

A resume always recomputes the digests (one read of the base, as loading it was), so no
write to the base escapes it, whatever it went through (``.data`` writes and
``load_safetensors``, which copies through ``.data``, do not move the version counter). A
save reuses the digests it computed last only for a base over ``_FRESH_BYTES`` (hashing runs
at 1.5 GB/s on one core of the 2-core dev VM: a 14 GB base would cost 10 s a save, 256 MiB
0.2 s; the probe of a 324 MiB base 1 ms), and only while every tensor keeps its storage,
its version and the CRCs of ``_PROBES`` blocks spread over it;
``load_safetensors`` drops them (``forget``). A partial ``.data`` write to a big base between
saves that misses every probed block goes unseen by the save's record (not by a resume).

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
import sys
import weakref
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError
from zeroshard.checkpoint.pieces import PARAM, PieceRecord, _deferred
from zeroshard.checkpoint.shard_file import CODES
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.layout import Segment
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

_PRIME = (1 << 61) - 1
_MASK = (1 << 64) - 1
_BLOCK = 1 << 16  # elements per CRC'd block of a tensor
METHOD = "crc32-blocks-65536"
_FRESH_BYTES = 256 << 20
"""Whole frozen tensors up to this many bytes in all are hashed anew at every save."""
_PROBES = 8
"""Blocks of a big frozen tensor whose CRCs tell a save its cached digest still holds."""


@dataclass(frozen=True)
class FrozenRun:
    """A frozen unit where the loader expects a run of the optimizer (only ``unit`` is read)."""

    unit: FlatUnit


def _managed_frozen(opt: Optional["ZeroOptimizer"]) -> list[FlatUnit]:
    engine = engine_of(opt)
    return list(engine.frozen_units) if engine is not None else []


def managed_ids(opt: Optional["ZeroOptimizer"]) -> set[int]:
    """ids of the tensors stage 3 shows for frozen parameters kept in frozen units."""
    out: set[int] = set()
    if opt is None:  # (no optimizer: no frozen units)
        return out
    for u in _managed_frozen(opt):
        for m in u.members:
            out.add(id(m.param))
            out.add(id(opt.engine.sharding.visible(m.param)))  # (stage 3's sharded one; the same one below)
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


def unit_segments(opt: Optional["ZeroOptimizer"]) -> Iterator[tuple[FlatUnit, Segment]]:
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


def is_peft_model(model: Optional[nn.Module]) -> bool:
    """``model`` carries PEFT adapters over a base: a ``PeftModel`` (or a model with adapters
    loaded, which has ``peft_config`` too), or PEFT tuner layers injected into a plain model."""
    if model is None:
        return False
    if isinstance(getattr(model, "peft_config", None), dict):
        return True
    if "peft" not in sys.modules:  # (no PEFT layer can exist before peft is imported)
        return False
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def save_frozen_default(model: Optional[nn.Module], opt: Any) -> bool:
    """Whether a save writes frozen weights when not told: all but a PEFT model's base
    (Note [frozen weights in checkpoints])."""
    engine = engine_of(opt)
    return not is_peft_model(model if model is not None else engine.module if engine is not None else None)


_CACHED: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
"""Per optimizer: the digests the last save computed, which the next may reuse."""


def forget(opt: Optional[object]) -> None:
    """Drops the digests a save would reuse (the frozen weights were written behind the
    version counters' back: ``load_safetensors``)."""
    if opt is not None:
        _CACHED.pop(opt, None)


def _probe(t: torch.Tensor) -> tuple[int, ...]:
    """CRCs of ``_PROBES`` blocks spread over ``t`` (first and last included)."""
    flat = t.detach().reshape(-1)
    blocks = -(-flat.numel() // _BLOCK)
    picks = sorted({round(i * (blocks - 1) / (_PROBES - 1)) for i in range(_PROBES)}) if blocks else []
    return tuple(_crc(flat[k * _BLOCK:(k + 1) * _BLOCK]) for k in picks)


def digests(model: Optional[nn.Module], opt: Any, fresh: bool = False) -> dict[str, dict]:
    """name -> {shape, dtype, digest} of every frozen parameter (a collective at stage 3:
    each rank hashes what it owns; the partial sums are gathered). ``fresh``: computed from
    the values now (a resume's check); otherwise what can be is reused (Note [frozen weights
    in checkpoints]): a frozen unit's digests until it is written, a big base's while its
    storage, version and probed blocks stay the same."""
    whole = whole_frozen(model, opt)
    cached = _CACHED.get(opt) if opt is not None and not fresh else None
    cached = cached or {"whole": {}, "units": None}
    out: dict[str, dict] = {}
    reuse = sum(t.numel() * t.element_size() for t in whole.values()) > _FRESH_BYTES
    kept = {}
    for name, t in whole.items():
        key = (t.data_ptr(), t._version, tuple(t.shape), t.dtype, _probe(t)) if reuse else None
        hit = cached["whole"].get(name)
        entry = hit[1] if reuse and hit is not None and hit[0] == key else _whole_digest(t)
        out[name] = entry
        if reuse:
            kept[name] = (key, entry)
    units_key = tuple(u.writes for u in _managed_frozen(opt))
    units = cached["units"] if cached["units"] is not None and cached["units"][0] == units_key else None
    if units_key and not fresh and opt.engine.comm.world_size > 1:  # (recomputing is a collective: all ranks or none)
        units = None if opt.engine.comm.any_true(units is None) else units
    if units_key:
        units = units if units is not None else (units_key, _unit_digests(opt))
        out.update(units[1])
    if opt is not None:
        _CACHED[opt] = {"whole": kept, "units": units}
    return {n: {"shape": e["shape"], "dtype": e["dtype"], "digest": f"{e['sum']:016x}"} for n, e in out.items()}


def _whole_digest(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": CODES[t.dtype], "sum": _blocks(t, 0, t.numel())[0]}


def streamed_digest(read: Callable[[int, int], torch.Tensor], numel: int, chunk: int = 64 * _BLOCK) -> str:
    """The digest a manifest's ``frozen`` entry records for a tensor of ``numel`` elements,
    read ``chunk`` elements at a time by ``read(a, b)`` (a multiple of ``_BLOCK``: every
    chunk holds whole blocks, so none straddles two reads)."""
    total = 0
    for a in range(0, numel, chunk):
        total += _blocks(read(a, min(numel, a + chunk)), a, numel)[0]
    return f"{total % _PRIME:016x}"


def _unit_digests(opt: Optional["ZeroOptimizer"]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    segments = list(unit_segments(opt))
    if segments and opt is not None:  # (segments come from opt's frozen units: none without opt)
        partial: dict[str, int] = {}
        pieces: dict[str, list] = {}
        for u in _managed_frozen(opt):
            lo, hi = u.owned
            swap = u.swap_holding("shard")
            with (swap.resident(u, ("shard",)) if swap is not None else contextlib.nullcontext()):
                for seg in u.layout.segments:
                    a, b = max(lo, seg.offset), min(hi, seg.end)
                    if a < b:
                        partial[seg.name], pieces[seg.name] = _blocks(u.shard[a - lo:b - lo], a - seg.offset,
                                                                      seg.numel)
        gathered = opt.engine.comm.all_gather_object((partial, pieces)) if opt.engine.comm.world_size > 1 else [(partial, pieces)]
        for u, seg in segments:
            total = sum(p.get(seg.name, 0) for p, _ in gathered)
            straddling: dict[int, list] = {}
            for _, ps in gathered:
                for k, off, data in ps.get(seg.name, ()):
                    straddling.setdefault(k, []).append((off, data))
            for k, parts in straddling.items():  # every rank CRCs the same assembled block
                total += _mix(k, zlib.crc32(b"".join(d for _, d in sorted(parts))))
            out[seg.name] = {"shape": list(seg.shape), "dtype": CODES[u.dtype], "sum": total % _PRIME}
    return out


def base_record(model: Optional[nn.Module], opt: Any, saved: bool) -> dict:
    """The manifest's ``frozen`` entry."""
    return {"saved": saved, "method": METHOD, "tensors": digests(model, opt)}


def frozen_pieces(opt: Optional["ZeroOptimizer"]) -> list[PieceRecord]:
    """This rank's pieces of the frozen units (``save_frozen=True`` at stage 3)."""
    records = []
    for u in _managed_frozen(opt):
        lo, hi = u.owned
        swap = u.swap_holding("shard")
        for piece in u.layout.pieces_in(lo, hi):
            ua, ub = piece.unit_offset, piece.unit_offset + piece.numel
            rec = PieceRecord(piece.segment.name, piece.start, piece.stop)
            rec.tensors[PARAM] = (_deferred(u.dtype, swap.read_range, u, "shard", ua, ub)
                                  if swap is not None else u.param_range(ua, ub))
            records.append(rec)
    return records


def frozen_needed(opt: Optional["ZeroOptimizer"], saved: set[str]) -> Iterator[tuple[str, int, int, FrozenRun, Any, None]]:
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
    mine = digests(model, opt, fresh=True)  # (whatever wrote the base since: Note [frozen weights in checkpoints])
    trained = [n for n in names if n not in mine]
    if trained:  # nothing would give them their values: the checkpoint holds none
        raise CheckpointMismatchError(
            f"{where} did not save its frozen weights {trained[:5]}{' ...' if len(trained) > 5 else ''}, and this "
            "model has them trainable (or not as floating-point parameters), so they would keep whatever values "
            "they have: freeze them (requires_grad_(False)) as in the run that saved it, or resume from a "
            "checkpoint saved with save_frozen=True")
    wrong = []
    for n in names:
        want, have = record["tensors"][n], mine[n]
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
