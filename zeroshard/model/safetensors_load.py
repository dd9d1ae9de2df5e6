"""Loading weights from safetensors into a zeroshard model, reading only this rank's ranges.

Accepts a Hugging Face directory (``model.safetensors.index.json`` plus shards, or a single
``model.safetensors``) or one ``.safetensors`` file. File names come from the index and are
checked to be plain names inside the directory (an index is data, not trusted paths).
At stage 3 each rank reads only the bytes of its owned pieces (``os.pread`` at offsets from
the file's validated header, no memory map); stages 0-2 read whole tensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING


import torch
from torch import nn

from zeroshard.checkpoint import frozen_base
from zeroshard.checkpoint.hf_files import RangeReader, peft_base_name, weight_map

from zeroshard.layout import as_real
from zeroshard.optim.registry import optimizer_for
from zeroshard.stages.stage3.secondary import params_written

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner


def _resolve_prefix(files: dict[str, str], model: nn.Module) -> dict[str, tuple[str, str]]:
    """model name -> (file, stored name). Hub checkpoints of a base model name tensors without
    the head model's prefix (``h.0.attn...`` for GPT2LMHeadModel's ``transformer.h.0.attn...``),
    and the other way round; map them as Hugging Face's loader does, by ``base_model_prefix``."""
    out = {name: (path, name) for name, path in files.items()}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix:
        for name, path in files.items():
            alias = name[len(prefix) + 1:] if name.startswith(prefix + ".") else f"{prefix}.{name}"
            out.setdefault(alias, (path, name))
    if _adapter_names(model):  # a PEFT model over the base: its names wrap the base's names
        for name in model.state_dict(keep_vars=True):
            base = peft_base_name(name)
            if base in out:
                out.setdefault(name, out[base])
    return out


def _adapter_names(model: nn.Module) -> list[str]:
    config = getattr(model, "peft_config", None)
    return list(config) if isinstance(config, dict) else []


def _is_adapter(name: str, adapters: list[str]) -> bool:
    return any(f".{a}." in f"{name}." for a in adapters)


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str, strict: bool = True) -> list[str]:
    """Loads parameters (and persistent buffers) by name; returns the names it did not find
    (an error instead when ``strict``). A PEFT model loads its base from the base model's
    files (names mapped as PEFT wraps them); its adapters are not expected there and are
    initialised by ``init_meta_weights``."""
    opt = optimizer_for(model)
    if opt is None:
        raise ValueError("load_safetensors needs the model to be managed by a ZeroOptimizer; for a "
                         "plain model use safetensors.torch.load_model")
    files = _resolve_prefix(weight_map(path), model)
    handles: dict[str, RangeReader] = {}

    def handle(name: str) -> tuple[RangeReader, str]:
        fname, stored = files[name]
        if fname not in handles:
            handles[fname] = RangeReader(fname)
        return handles[fname], stored
    try:
        return _load(opt, model, path, files, handle, strict)
    finally:
        # (whole tensors are written through .data, which moves no version counter: a save
        # must not reuse the old base's digests. Note [frozen weights in checkpoints])
        frozen_base.forget(opt)
        for h in handles.values():
            h.close()


def _load(opt: "EngineOwner", model: nn.Module, path: str, files: dict, handle, strict: bool) -> list[str]:
    missing, wrong = [], []
    where = opt.engine.segment_index()
    for unit in opt.engine.joined().all_units:
        complete = True
        for m, seg in zip(unit.members, unit.layout.segments):
            if seg.name not in files:
                missing.append(seg.name)
                complete = False
                continue
            f, stored_name = handle(seg.name)
            stored = f.shape(stored_name)
            kind = f.dtype(stored_name).is_complex, seg.complex_dtype is not None  # (Note [complex parameters])
            if list(stored) != list(seg.param_shape) or kind[0] != kind[1]:
                wrong.append(f"{seg.name}: file {f.dtype(stored_name)}{list(stored)} vs model "
                             f"{seg.complex_dtype or unit.dtype}{list(seg.param_shape)}")
                continue
            lo, hi = (unit.owned if unit.policy.shard_parameters else (seg.offset, seg.end))
            a, b = max(lo, seg.offset), min(hi, seg.end)
            if a < b:
                w = 2 if kind[1] else 1  # (a complex file's elements: pieces are whole complex numbers)
                values = as_real(f.read(stored_name, (a - seg.offset) // w, (b - seg.offset) // w)).reshape(-1)
                unit.load_segment(a, values.float() if unit.separate_master else values)
        if complete:  # (a unit of PEFT adapters stays to be initialised: init_meta_weights)
            unit.needs_init = False
        params_written(unit)  # (hpZ: the secondary slice follows)
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in where:
            continue
        if key in files:
            f, stored_name = handle(key)
            if list(f.shape(stored_name)) != list(t.shape):
                wrong.append(f"{key}: file {f.shape(stored_name)} vs model {list(t.shape)}")
                continue
            t.data.copy_(f.read(stored_name, 0, t.numel()).view(t.shape))
        elif isinstance(t, nn.Parameter):
            missing.append(key)
    if opt.engine.shards_parameters:  # a unit gathered now holds the old values: drop it
        opt.engine.stage3_gatherer.release_all()
    if wrong:
        raise ValueError("shapes differ between the files and the model: " + "; ".join(wrong[:10]))
    adapters = _adapter_names(model)
    if missing and strict and not all(_is_adapter(n, adapters) for n in missing):
        missing_base = [n for n in missing if not _is_adapter(n, adapters)]
        raise ValueError(f"{len(missing_base)} parameters are not in {path}: {missing_base[:10]}"
                         + (" ..." if len(missing_base) > 10 else "") + " (strict=False to skip them)")
    return missing
