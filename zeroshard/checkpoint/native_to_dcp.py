"""``zeroshard convert-dcp`` from zeroshard's native format to a torch Distributed Checkpoint,
streamed: each tensor (weights, each optimizer state) is one ``Pieces`` whose data is a
``Deferred`` that reads it from the native pieces holding it (a bounded reader: one verified
checksum block at a time) when torch's planner asks the writer for it; the writer
(``dcp_stream_writer``) drops each chunk once written, so memory holds about one tensor and
one block, not the state (Note [streaming DCP conversion]).

What is written is what loading the native step into a world-1, stage-1 ZeroOptimizer of the
saved optimizer class and saving it as DCP writes (a test compares them tensor by tensor).
"""
from __future__ import annotations

import json
import math
import os

import torch

from zeroshard.checkpoint import jsontree, manifest, rng, tp_layout
from zeroshard.checkpoint.dcp_write import Pieces, write_state
from zeroshard.checkpoint.pieces import PARAM
from zeroshard.checkpoint.shard_file import DTYPES, Deferred, ShardReader, read_json

_BLOCKS = 1
"""Verified checksum blocks a reader keeps (as ``export_hf``): memory holds one block per file."""
_CHUNK_ELEMS = 2 << 20
"""Elements copied out of a reader at a time."""


class _Native:
    """One native step's data files, read through bounded readers."""

    def __init__(self, step_dir: str, body: dict) -> None:
        self.dir, self.body = step_dir, body
        self.readers: dict[str, ShardReader] = {}

    def reader(self, fname: str) -> ShardReader:
        if fname not in self.readers:
            self.readers[fname] = ShardReader(os.path.join(self.dir, fname), self.body["files"][fname],
                                              max_blocks=_BLOCKS)
        return self.readers[fname]

    def _stored(self, meta: dict, kind: str, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of kind ``kind`` in stored order, from the pieces holding them."""
        out = torch.empty(b - a, dtype=dtype)
        for p in meta["pieces"]:
            lo, hi = max(a, p["start"]), min(b, p["stop"])
            reader, key = self.reader(p["file"]), p["keys"][kind]
            for x in range(lo, hi, _CHUNK_ELEMS):
                y = min(hi, x + _CHUNK_ELEMS)
                out[x - a:y - a].copy_(reader.get(key, x - p["start"], y - p["start"]))
        return out

    def whole(self, name: str, kind: str) -> Deferred:
        """Tensor ``name``'s ``kind`` (flat, in global order), read when the writer asks."""
        meta = self.body["tensors"][name]
        first = meta["pieces"][0]
        for p in meta["pieces"]:
            self.reader(p["file"]).check_piece(name, p, meta["dtype"])
        dtype = self.reader(first["file"]).entries[first["keys"][kind]].dtype
        numel = math.prod(meta["shape"])
        split = tp_layout.split_of(meta)

        def read() -> torch.Tensor:
            if tp_layout.global_order(split):
                return self._stored(meta, kind, 0, numel, dtype)
            ranges, build = tp_layout.plan(meta["shape"], split, None, 0, numel)  # (Note [stored order])
            return build([self._stored(meta, kind, a, b, dtype) for a, b in ranges])
        return Deferred(dtype, (numel,), read)


def _per_rank(step_dir: str, body: dict) -> dict[str, object]:
    """Every saving rank's RNG states and data position, as a DCP save at that world size writes
    them (``train_state.rng.rank{r}`` / ``.dataloader.rank{r}``, JSON), so a DCP resume at the
    saving world size continues exactly; with no RNG file at all (a trimmed checkpoint) this
    process's states at world 1, as before."""
    world = int(body["world_size"])
    states = {}
    for r in range(world):
        fname = manifest.rng_file(r)
        if fname in body["files"]:
            path = os.path.join(step_dir, fname)
            states[f"rank{r}"] = json.dumps(jsontree.encode(rng.check(read_json(path, body["files"][fname]), path), "rng"))
    if len(states) != world:
        return {"rng": {"rank0": json.dumps(rng.capture())}, "world_size": 1}
    out: dict[str, object] = {"rng": states, "world_size": world}
    loaders = (body.get("trainer") or {}).get("dataloader") or []
    if len(loaders) == world and all(state is not None for state in loaders):  # (each rank's, encoded already)
        out["dataloader"] = {f"rank{r}": json.dumps(state) for r, state in enumerate(loaders)}
    return out


def to_dcp(step_dir: str, body: dict, dst: str, options: dict[str, dict]) -> str:
    """Writes ``dst/step-N`` from the native step ``step_dir`` (``body``: its checked manifest;
    ``options``: each trained parameter's param-group options as a loading optimizer holds them)."""
    src = _Native(step_dir, body)
    model_sd: dict[str, object] = {}
    optim_sd: dict[str, object] = {}
    states: dict[str, dict[str, Pieces]] = {}
    for name, meta in body["tensors"].items():
        shape = tuple(meta["shape"])
        numel = math.prod(shape)
        weights = Pieces(shape, DTYPES[meta["dtype"]])
        weights.add(0, numel, src.whole(name, PARAM))
        model_sd[name] = weights
        if name not in options:  # (buffers, frozen weights: the model's alone)
            continue
        first = meta["pieces"][0]
        for kind in first["keys"]:
            if kind.startswith("state."):
                state = src.whole(name, kind)
                states.setdefault(kind, {})[f"state.{name}.{kind[6:]}"] = chunks = Pieces(shape, state.dtype)
                chunks.add(0, numel, state)
        for k, v in jsontree.decode(first["scalars"], f"{step_dir}: {name} scalars").items():
            optim_sd[f"state.{name}.{k}"] = v.detach().clone().reshape(()) if isinstance(v, torch.Tensor) \
                else torch.tensor(float(v), dtype=torch.float32)  # (Adam's step, as FSDP2 keeps it)
        for k, v in options[name].items():
            optim_sd[f"param_groups.{name}.{k}"] = v
    for part in states.values():  # (kind by kind, the native file's order: each block is read once)
        optim_sd.update(part)
    trainer = body.get("trainer") or {}
    extra = jsontree.decode(trainer.get("extra"), f"{step_dir}: trainer.extra")
    train: dict[str, object] = {**_per_rank(step_dir, body), "step": body["step"],
                                **({"extra": extra} if extra is not None else {})}
    sd: dict[str, object] = {"model": model_sd, "optimizer": optim_sd, "train_state": train}
    if trainer.get("scheduler") is not None:
        sd["lr_scheduler"] = jsontree.decode(trainer["scheduler"], f"{step_dir}: trainer.scheduler")
    return write_state(os.fspath(dst), int(body["step"]), sd)
