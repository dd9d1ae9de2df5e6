"""Loading weights from safetensors into a zeroshard model, reading only this rank's ranges.

Accepts a Hugging Face directory (``model.safetensors.index.json`` plus shards, or a single
``model.safetensors``) or one ``.safetensors`` file. File names come from the index and are
checked to be plain names inside the directory (an index is data, not trusted paths).
At stage 3 each rank reads only the rows that cover its owned pieces
(``safe_open(...).get_slice(name)[r0:r1]``); stages 0-2 read whole tensors.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from zeroshard.optim.registry import optimizer_for


def _weight_map(path: str) -> dict[str, str]:
    if os.path.isfile(path):
        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            raw = json.load(f).get("weight_map")
        if not isinstance(raw, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        out = {}
        for name, fname in raw.items():
            if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
                raise ValueError(f"{index} maps {name!r} to {fname!r}, which is not a plain file name "
                                 "in that directory; refusing to read it")
            out[name] = os.path.join(path, fname)
        return out
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return _weight_map(single)
    raise FileNotFoundError(f"{path} holds neither model.safetensors.index.json nor model.safetensors")


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
    return out


def _read_range(f, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
    """Flat range [start, stop) of a stored tensor, reading only the rows that cover it."""
    sl = f.get_slice(name)
    if len(shape) <= 1:
        return sl[start:stop].reshape(-1) if len(shape) == 1 else f.get_tensor(name).reshape(-1)
    row = shape[1:].numel()
    r0, r1 = start // row, -(-stop // row)
    rows = sl[r0:r1].reshape(-1)
    return rows[start - r0 * row:stop - r0 * row]


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str, strict: bool = True) -> list[str]:
    """Loads parameters (and persistent buffers) by name; returns the names it did not find
    (an error instead when ``strict``)."""
    opt = optimizer_for(model)
    if opt is None:
        raise ValueError("load_safetensors needs the model to be managed by a ZeroOptimizer; for a "
                         "plain model use safetensors.torch.load_model")
    files = _resolve_prefix(_weight_map(path), model)
    handles: dict[str, object] = {}

    def handle(name: str):
        fname, stored = files[name]
        if fname not in handles:
            handles[fname] = safe_open(fname, framework="pt")
        return handles[fname], stored

    missing, wrong = [], []
    where = opt.segment_index()
    for unit in opt.units:
        for m, seg in zip(unit.members, unit.layout.segments):
            if seg.name not in files:
                missing.append(seg.name)
                continue
            f, stored_name = handle(seg.name)
            stored = f.get_slice(stored_name).get_shape()
            if list(stored) != list(seg.shape):
                wrong.append(f"{seg.name}: file {list(stored)} vs model {list(seg.shape)}")
                continue
            lo, hi = (unit.owned if unit.policy.shard_parameters else (seg.offset, seg.end))
            a, b = max(lo, seg.offset), min(hi, seg.end)
            if a < b:
                values = _read_range(f, stored_name, seg.shape, a - seg.offset, b - seg.offset)
                unit.load_segment(a, values.float() if unit.separate_master else values)
        unit.needs_init = False
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in where:
            continue
        if key in files:
            f, stored_name = handle(key)
            t.data.copy_(f.get_tensor(stored_name))
        elif isinstance(t, nn.Parameter):
            missing.append(key)
    if opt.gatherer is not None:  # a unit gathered now holds the old values: drop it
        opt.gatherer.release_all()
    if wrong:
        raise ValueError("shapes differ between the files and the model: " + "; ".join(wrong[:10]))
    if missing and strict:
        raise ValueError(f"{len(missing)} parameters are not in {path}: {missing[:10]}"
                         + (" ..." if len(missing) > 10 else "") + " (strict=False to skip them)")
    return missing
