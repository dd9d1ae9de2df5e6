"""``export_hf``: a checkpoint's parameters in the Hugging Face safetensors layout, streamed.

Output: ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Shards
are planned from the manifest alone (shapes and dtypes), then each output file is written
tensor by tensor and each tensor piece by piece, reading only the verified blocks holding
that piece (at most ``_BLOCKS`` cached per input file). Memory stays at about one piece
plus a few checksum blocks, below one output shard, whatever the model size.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import torch

from zeroshard.checkpoint import tp_layout
from zeroshard.checkpoint.pieces import PARAM
from zeroshard.checkpoint.shard_file import COMPLEX_DTYPES, DTYPES, ShardReader, header_bytes, tensor_bytes, write_stream
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.locate import candidates, check_structure, is_step_dir

if TYPE_CHECKING:
    from zeroshard.checkpoint.export_base import BaseSource

_BLOCKS = 1
_CHUNK_ELEMS = 2 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
Progress = Callable[[int, int], None]


def parse_size(size: Union[int, str]) -> int:
    """``"2GB"``, ``"500MiB"`` or a byte count."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size={size} must be positive")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use a byte count or a size like '2GB' or '500MiB'")
    return max(1, int(float(m.group(1)) * _UNITS[m.group(2) or ""]))


def _out_dtype(dtype: Union[None, str, torch.dtype], saved: torch.dtype) -> torch.dtype:
    if dtype is None or not saved.is_floating_point:
        return saved
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPE_NAMES)} or a torch.dtype")
    return _DTYPE_NAMES[dtype.lower()]


def plan_shards(body: dict, max_bytes: int, dtype,
                extra: Optional[dict[str, dict]] = None) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Tensors grouped greedily into shards of at most ``max_bytes`` (a bigger tensor alone).
    Tied aliases are written too (a copy of their target each), so a strict
    ``model.load_state_dict`` of the export finds every key of ``model.state_dict()``;
    transformers re-ties them on load either way. ``extra``: name -> {shape, dtype} of more
    tensors (a lean checkpoint's frozen weights, from its base)."""
    aliases = body.get("aliases", {})
    shards: list[list] = [[]]
    size = 0
    entries = [(n, m) for n, m in body["tensors"].items() if n not in aliases]
    entries += [(alias, body["tensors"][target]) for alias, target in aliases.items() if target in body["tensors"]]
    entries += list((extra or {}).items())
    for name, meta in entries:
        out = _out_dtype(dtype, DTYPES[meta["dtype"]])
        shape = tuple(meta["shape"])
        if "complex_dtype" in meta:  # its reals' bytes are the complex tensor's, never cast (Note [complex parameters])
            out, shape = COMPLEX_DTYPES[meta["complex_dtype"]], shape[:-1]
        n = out.itemsize
        for d in shape:
            n *= d
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, out, shape))
        size += n
    return shards if shards[-1] else shards[:-1]


def export_hf(step_dir: str, out_dir: str, max_shard_size: Union[int, str] = "2GB",
              dtype: Union[None, str, torch.dtype] = None, progress: Optional[Progress] = None,
              base: Optional[str] = None) -> str:
    """Writes the checkpoint's model weights to ``out_dir`` in the Hugging Face layout and
    returns the index path. ``dtype`` casts floating-point tensors (default: as saved).
    ``progress(done_bytes, total_bytes)`` is called as data is written. ``base``: the base
    model's Hugging Face directory (safetensors), for a checkpoint that recorded its frozen
    weights without saving them (a PEFT model's): they are read from there, each checked
    against the digest the checkpoint recorded, and the whole model is written."""
    if base is not None and not isinstance(base, (str, os.PathLike)):
        raise TypeError(f"base={base!r}: pass the base model's directory (a path)")
    step_dir, body = _choose(step_dir)
    frozen = body.get("frozen") or {}
    missing = sorted(set(frozen.get("tensors", {})) - set(body["tensors"]))
    if missing and base is None:  # a LoRA checkpoint: the model would be incomplete (Note [frozen weights in checkpoints])
        raise ValueError(f"{step_dir} holds only what trains: its {len(missing)} frozen weights (e.g. {missing[:2]}) "
                         "were not saved, so it is not a whole model. Pass the base model's directory "
                         "(zeroshard export --base DIR, export_hf(..., base=DIR)) to write the whole model, export "
                         "the trained model with zeroshard.export_merged(model, dir) / zeroshard.save_adapter(model, "
                         "dir), or save with save_checkpoint(..., save_frozen=True)")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output {out_dir!r} exists and is not a directory")
    source = None
    if missing and base is not None:
        # (imported here: export_base reads safetensors as the stage-3 loader, which imports this
        # package while zeroshard is being initialised)
        from zeroshard.checkpoint.export_base import BaseSource
        source = BaseSource(os.fspath(base), missing, frozen, step_dir)
    extra = {n: {"shape": frozen["tensors"][n]["shape"], "dtype": frozen["tensors"][n]["dtype"]} for n in missing}
    readers: dict[str, ShardReader] = {}
    try:
        shards = plan_shards(body, parse_size(max_shard_size), dtype, extra)
        return _write(step_dir, body, shards, out_dir, readers, progress, source)
    finally:
        for r in readers.values():
            r.release()
        if source is not None:
            source.close()


def _choose(path: str) -> tuple[str, dict]:
    """The step to export and its manifest: the given step, or the newest under a root
    passing every check short of reading the data (``locate.check_structure``: the step a
    load would take). Data checksums are verified as the data is read."""
    if is_step_dir(path):
        return path, check_structure(path)
    reasons = []
    for step_dir in candidates(path):
        try:
            return step_dir, check_structure(step_dir)
        except CheckpointCorruptError as exc:
            reasons.append(str(exc))
    if reasons:
        raise CheckpointCorruptError(f"no valid checkpoint under {path!r}: " + "; ".join(reasons))
    raise FileNotFoundError(f"{path!r} is neither a step directory nor a root holding one")


def _reader(step_dir: str, body: dict, readers: dict[str, ShardReader], fname: str) -> ShardReader:
    if fname not in readers:
        readers[fname] = ShardReader(os.path.join(step_dir, fname), body["files"][fname], max_blocks=_BLOCKS)
    return readers[fname]


def _write(step_dir: str, body: dict, shards: list, out_dir: str, readers: dict[str, ShardReader],
           progress: Optional[Progress], source: Optional["BaseSource"] = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    total = sum(_nbytes(d, s) for shard in shards for _, d, s in shard)
    done = 0
    weight_map = {}
    n = len(shards)
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        head, _ = header_bytes(shard, {"format": "pt"})

        def chunks() -> Iterator[memoryview]:
            nonlocal done
            for name, out, _ in shard:
                pieces = source.chunks(name, out) if source is not None and name in source.tensors else \
                    _pieces(step_dir, body, readers, name, out)
                for piece in pieces:
                    done += len(piece)
                    yield piece
                    if progress is not None:
                        progress(done, total)

        tmp = os.path.join(out_dir, fname + ".tmp")
        try:
            write_stream(tmp, head, chunks())
        except BaseException:
            if os.path.exists(tmp):  # a damaged block mid-file: leave no partial shard behind
                os.unlink(tmp)
            raise
        os.replace(tmp, os.path.join(out_dir, fname))
        weight_map.update({name: fname for name, _, _ in shard})
    if isinstance(body.get("model_config"), dict):  # saved from a Hugging Face model
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(body["model_config"], f, indent=2)
    index = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total, "format": "pt", "zeroshard_step": body["step"]},
                   "weight_map": weight_map}, f, indent=2)
    return index


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _pieces(step_dir: str, body: dict, readers: dict[str, ShardReader], name: str,
            out: torch.dtype) -> Iterator[memoryview]:
    """The bytes of tensor ``name`` in ``out`` dtype, one saved piece at a time (a tensor stored
    in tp chunks along a dimension > 0 is put back in order a few rows at a time: Note [stored
    order] in tp_layout.py)."""
    meta = body["tensors"][body.get("aliases", {}).get(name, name)]
    out = out.to_real() if out.is_complex else out  # (a complex parameter's reals, in order: its bytes)
    split = tp_layout.split_of(meta)
    if split is not None and split.dim > 0:
        numel = math.prod(meta["shape"])
        for lo in range(0, numel, _CHUNK_ELEMS):
            ranges, build = tp_layout.plan(meta["shape"], split, None, lo, min(numel, lo + _CHUNK_ELEMS))
            parts = [_stored(step_dir, body, readers, meta, a, b) for a, b in ranges]
            yield tensor_bytes(build(parts).to(out))
        return
    for p in meta["pieces"]:
        key = p["keys"][PARAM]  # present and matching the header: checked before writing
        reader = _reader(step_dir, body, readers, p["file"])
        n = p["stop"] - p["start"]
        for lo in range(0, n, _CHUNK_ELEMS):  # a tensor bigger than a shard streams in chunks too
            yield tensor_bytes(reader.get(key, lo, min(n, lo + _CHUNK_ELEMS)).to(out))


def _stored(step_dir: str, body: dict, readers: dict[str, ShardReader], meta: dict, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of a tensor in its stored order, from the pieces holding them."""
    parts = [_reader(step_dir, body, readers, p["file"]).get(p["keys"][PARAM], max(a, p["start"]) - p["start"],
                                                             min(b, p["stop"]) - p["start"])
             for p in meta["pieces"] if p["start"] < b and p["stop"] > a]
    return torch.cat(parts) if parts else torch.empty(0, dtype=DTYPES[meta["dtype"]])
