"""Exporting a PEFT (LoRA) fine-tune trained with zeroshard: the adapter in PEFT's own format,
and the merged model as sharded safetensors that ``from_pretrained`` loads.

Both are collectives (every rank calls them; rank 0 writes). ``save_adapter`` gathers only
the trainable units, never the base. ``export_merged`` streams: it walks the stage-3 gather
groups one at a time (a block's frozen base and its adapters are one group), computes each
merged weight with PEFT's own ``get_delta_weight`` while the group is gathered, and writes
output shards as they fill, so memory stays at one group plus one output shard whatever the
model size. Shards are planned first from the shapes, in the order tensors are produced.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from zeroshard.checkpoint.export import parse_size
from zeroshard.optim.registry import optimizer_for
from zeroshard.stages.stage3.full_state import full_state_dict


def _peft_parts(model: nn.Module) -> tuple[Any, list[str]]:
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not callable(getattr(model, "get_base_model", None)):
        raise TypeError(f"{type(model).__name__} is not a PEFT model (peft.get_peft_model(...) makes one)")
    return config, list(config)


def _rank(model: nn.Module) -> int:
    opt = optimizer_for(model)
    return opt.comm.rank if opt is not None else 0


def save_adapter(model: nn.Module, out_dir: str) -> Optional[str]:
    """Writes the adapter(s) as ``PeftModel.save_pretrained`` does (``adapter_config.json`` and
    ``adapter_model.safetensors``), loadable by ``PeftModel.from_pretrained(base, out_dir)``.
    Returns ``out_dir`` on rank 0, None elsewhere."""
    _peft_parts(model)
    state = full_state_dict(model, rank0_only=True, frozen=False)
    if _rank(model) != 0:
        return None
    model.save_pretrained(out_dir, state_dict={k: v.contiguous() for k, v in state.items()})
    return out_dir


def _base_name(name: str) -> str:
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def _lora_layers(model: nn.Module) -> dict[int, nn.Module]:
    """id(base weight) -> the LoRA layer wrapping it (only layers with unmerged active adapters)."""
    out: dict[int, nn.Module] = {}
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if callable(getattr(module, "get_delta_weight", None)) and isinstance(base, nn.Module):
            if getattr(module, "merged", False):
                raise ValueError("the model has merged adapters already (merge_adapter()); unmerge them first")
            out[id(base.weight)] = module
    return out


class _Groups:
    """Which gather groups hold what, and gathering them (stage 3; one group, always "gathered",
    below it)."""

    def __init__(self, model: nn.Module) -> None:
        opt = optimizer_for(model)
        self.gatherer = opt.gatherer if opt is not None else None
        self.where = opt.segment_index() if opt is not None else {}
        self.model = model

    def group_of(self, t: torch.Tensor) -> int:
        if self.gatherer is None or id(t) not in self.where:
            return -1
        unit = self.where[id(t)][0]
        return self.gatherer.group_of[next(i for i, u in enumerate(self.gatherer.units) if u is unit)]

    def order(self) -> list[int]:
        return list(range(len(self.gatherer.groups))) if self.gatherer is not None else []

    def gathered(self, gi: int) -> "_Gathered":
        return _Gathered(self, gi)


class _Gathered:
    def __init__(self, groups: _Groups, gi: int) -> None:
        self.g, self.gi = groups, gi

    def __enter__(self) -> None:
        if self.g.gatherer is not None and self.gi >= 0:
            self.g.gatherer.ensure_group(self.gi)

    def __exit__(self, *exc: Any) -> None:
        if self.g.gatherer is not None and self.gi >= 0:
            self.g.gatherer.release_group(self.gi)


def _plan(model: nn.Module, groups: _Groups) -> list[tuple[int, list[str]]]:
    """(group, state_dict keys it produces), in production order; group -1: unmanaged tensors."""
    live = model.state_dict(keep_vars=True)
    by_group: dict[int, list[str]] = {}
    for key, t in live.items():
        if ".lora_" in key:  # the adapters themselves: merged into their base weights
            continue
        by_group.setdefault(groups.group_of(t), []).append(key)
    return [(gi, by_group[gi]) for gi in groups.order() + [-1] if gi in by_group]


@torch.no_grad()
def export_merged(model: nn.Module, out_dir: str, max_shard_size: Union[int, str] = "2GB",
                  dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Merges the LoRA adapters into the base weights and writes the base model's Hugging Face
    layout (``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json`` and the
    base's ``config.json``), loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)``.
    Streamed one gather group at a time; a collective. Returns ``out_dir`` on rank 0."""
    _peft_parts(model)
    from safetensors.torch import save_file
    limit = parse_size(max_shard_size)
    groups = _Groups(model)
    plan = _plan(model, groups)
    live = model.state_dict(keep_vars=True)
    shapes = {k: (tuple(live[k].shape), dtype or live[k].dtype) for _, keys in plan for k in keys}
    shards, size = [[]], 0
    for _, keys in plan:
        for k in keys:
            shape, dt = shapes[k]
            n = torch.Size(shape).numel() * dt.itemsize
            if shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(k)
            size += n
    total = len(shards)
    file_of = {k: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, ks in enumerate(shards) for k in ks}
    writer = _ShardWriter(out_dir, file_of, writes=_rank(model) == 0, save=save_file)
    layers = _lora_layers(model)
    for gi, keys in plan:
        needed = {gi} | {groups.group_of(p) for k in keys if id(live[k]) in layers
                         for p in layers[id(live[k])].parameters() if p.requires_grad}
        with _many(groups, sorted(needed)):
            current = model.state_dict(keep_vars=True)  # (gathered: the unsharded views)
            for k in keys:
                t = current[k].detach()
                layer = layers.get(id(live[k]))
                if layer is not None:
                    t = t.float()
                    for adapter in layer.active_adapters:
                        if adapter in getattr(layer, "lora_A", {}):
                            t = t + layer.get_delta_weight(adapter).float()
                writer.add(_base_name(k), t.to(shapes[k][1]))
    writer.close()
    if _rank(model) != 0:
        return None
    base = model.get_base_model()
    if getattr(base, "config", None) is not None:
        base.config.save_pretrained(out_dir)
    return out_dir


class _many:
    def __init__(self, groups: _Groups, gis: list[int]) -> None:
        self.items = [groups.gathered(g) for g in gis]

    def __enter__(self) -> None:
        for g in self.items:
            g.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for g in reversed(self.items):
            g.__exit__(*exc)


class _ShardWriter:
    """Holds one output shard at a time; writes it when its last tensor arrives."""

    def __init__(self, out_dir: str, file_of: dict[str, str], writes: bool, save: Any) -> None:
        self.out_dir, self.writes, self.save = out_dir, writes, save
        self.file_of = {_base_name(k): f for k, f in file_of.items()}
        self.left: dict[str, int] = {}
        for f in self.file_of.values():
            self.left[f] = self.left.get(f, 0) + 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.total = 0
        if writes:
            os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        if not self.writes:
            return
        f = self.file_of[name]
        self.pending.setdefault(f, {})[name] = t.detach().to("cpu").contiguous().clone()
        self.total += t.numel() * t.element_size()
        self.left[f] -= 1
        if self.left[f] == 0:
            self.save(self.pending.pop(f), os.path.join(self.out_dir, f), metadata={"format": "pt"})

    def close(self) -> None:
        if not self.writes:
            return
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.file_of.items()))}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=2)
