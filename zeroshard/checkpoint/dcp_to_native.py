"""``zeroshard convert-dcp`` from a torch Distributed Checkpoint to zeroshard's native format,
streamed: the native data file is written one tensor at a time, each read from the DCP chunks
that hold it as the writer reaches it (a ``Deferred``), so memory holds about one tensor and
its chunks, not the state (Note [streaming DCP conversion]).

What is written is what loading the DCP checkpoint into a world-1, stage-1 ZeroOptimizer of
the saved optimizer class and saving it natively writes: the same pieces, manifest and
trainer state (a test compares the two tensor by tensor).
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from zeroshard.checkpoint import commit, jsontree, manifest, rng, validate
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.dcp_read import IMPLEMENTATION_OPTIONS, DcpSource, elementwise, saved_extra, saved_step
from zeroshard.checkpoint.pieces import PARAM, PieceRecord
from zeroshard.checkpoint.shard_file import CODES, Deferred
from zeroshard.comm import Comm


def _whole(src: DcpSource, key: str, flat: bool = True) -> Deferred:
    """Tensor ``key``, read when the writer reaches it (flattened, as a piece is stored)."""
    entry = src.tensor(key)
    numel, shape = math.prod(entry.size), tuple(entry.size)
    return Deferred(entry.properties.dtype, (numel,) if flat else shape,
                    lambda: src.flat_range(key, 0, numel).reshape((numel,) if flat else shape))


def _rng(src: DcpSource, train: dict) -> dict:
    """Rank 0's saved RNG state when the checkpoint was saved at world 1 (a load restores it,
    then a save captures it), else this process's (Note [DCP format mapping])."""
    states = train.get("rng") or {}
    text = states.get("rank0") if isinstance(states, dict) else None
    if train.get("world_size", len(states) or None) == 1 and isinstance(text, str):
        return jsontree.encode(rng.check(json.loads(text), f"{src.dir}: train_state.rng.rank0"), "rng")
    return rng.capture()


def _dataloader(src: DcpSource, train: dict) -> object:
    loaders = train.get("dataloader") or {}
    mine = loaders.get("rank0") if isinstance(loaders, dict) else None
    if train.get("world_size") == 1 and isinstance(mine, str):
        return jsontree.encode(jsontree.decode(json.loads(mine), f"{src.dir}: train_state.dataloader.rank0"),
                               "dataloader")
    section = src.section("dataloader")
    return jsontree.encode(section, "dataloader") if section is not None else None


def to_native(src_dir: str, dst: str, per_param: dict[str, dict], groups: list[list[str]], live: list[dict],
              inner: str, precision: Optional[str]) -> str:
    """Writes ``dst/step-N`` from DCP ``src_dir``. ``groups``: the trained parameters' names by
    param group; ``live``: each group's options as a fresh ZeroOptimizer holds them (``inner``
    its inner optimizer's class name, ``precision`` its mixed precision)."""
    src = DcpSource(src_dir, keep_chunks=False)
    names = src.model_names()
    train = src.section("train_state") or {}
    if not isinstance(train, dict):
        raise CheckpointCorruptError(f"{src_dir}: train_state is not a dict")
    step = saved_step(train)
    okeys: dict[str, dict[str, str]] = {}
    for k in src.entries:
        if k.startswith("optimizer.state."):
            fqn, kind = k[len("optimizer.state."):].rsplit(".", 1)
            okeys.setdefault(fqn, {})[kind] = k
    records, shapes = [], {}
    for gi, members in enumerate(groups):
        for name in members:
            entry = names[name]
            numel = math.prod(entry.size)
            rec = PieceRecord(name, 0, numel, {PARAM: _whole(src, src.model_prefix + name)})
            for kind, key in okeys.get(name, {}).items():
                e = src.entries[key]
                if elementwise(e, tuple(entry.size), kind):  # (as dcp_read's rule)
                    rec.tensors[f"state.{kind}"] = _whole(src, key)
                else:  # (Adam's step: a 0-d tensor, kept as the engine keeps it)
                    rec.scalars[kind] = jsontree.encode(src.value(key), f"optimizer state {kind!r}")
            records.append(rec)
            shapes[name] = {"shape": list(entry.size), "dtype": CODES[entry.properties.dtype], "group": gi,
                            "kind": "sharded"}
    full: dict[str, "torch.Tensor | Deferred"] = {}
    for name, entry in names.items():
        if name not in per_param:  # (a buffer, or a parameter no group trains: written whole)
            full[name] = _whole(src, src.model_prefix + name, flat=False)
            shapes[name] = {"shape": list(entry.size), "dtype": CODES[entry.properties.dtype], "group": None,
                            "kind": "full"}
    snap = commit.Snapshot(step, records, full, _rng(src, train), _dataloader(src, train))  # type: ignore[arg-type]
    groups_out = []
    for members, options in zip(groups, live):
        saved = per_param[members[0]]
        merged = {**options, **{k: v for k, v in saved.items() if k in options and k not in IMPLEMENTATION_OPTIONS}}
        groups_out.append({**merged, "params": members})
    scheduler = src.section("lr_scheduler")
    snap.header = {
        "format": manifest.FORMAT, "version": manifest.VERSION, "step": step, "world_size": 1, "stage": 1,
        "mixed_precision": precision, "optimizer": inner,
        "param_groups": jsontree.encode(groups_out, "param_groups"), "aliases": {}, "model_config": None,
        "trainer": {"scheduler": jsontree.encode(scheduler, "scheduler") if scheduler is not None else None,
                    "loss_scaler": None, "extra": jsontree.encode(saved_extra(src_dir, train), "extra")},
    }
    validate.check_header(snap.header, f"step {step}")
    return commit.commit(snap, os.fspath(dst), Comm(None), shapes, None)
