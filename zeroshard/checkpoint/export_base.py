"""``export_hf(..., base=DIR)``: the frozen weights a lean checkpoint recorded but did not save,
read from the base model's Hugging Face directory (Note [frozen weights in checkpoints] in
frozen_base.py).

Each one is found in the base's files under the checkpoint's name, its PEFT base name
(``base_model.model.`` and ``.base_layer.`` dropped) or with the head model's prefix dropped
or added, cast to the dtype the checkpoint recorded (the model's: a bf16 file loaded into an
fp32 model), and its digest compared with the recorded one before anything is written: an
export never mixes a checkpoint with a base it was not trained on. The base is read twice
(digests, then the write), a chunk at a time, so memory stays at a few chunks.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from zeroshard.checkpoint import frozen_base
from zeroshard.checkpoint.shard_file import DTYPES, tensor_bytes
from zeroshard.checkpoint.hf_files import RangeReader, peft_base_name, weight_map

_CHUNK = 64 << 16  # elements per read: whole digest blocks (frozen_base._BLOCK)


@dataclass(frozen=True)
class BaseTensor:
    """Where a frozen weight of the checkpoint lies in the base's files."""

    file: str
    stored: str
    dtype: torch.dtype
    """The dtype the checkpoint recorded (the values are cast to it, then hashed)."""
    shape: tuple[int, ...]


def _stored_name(name: str, stored: set[str]) -> Optional[str]:
    for cand in dict.fromkeys((name, peft_base_name(name))):
        if cand in stored:
            return cand
        rest = cand.partition(".")[2]  # (a head model's name, a base model's file)
        if rest in stored:
            return rest
        prefixed = [s for s in stored if s.endswith(f".{cand}") and s.count(".") == cand.count(".") + 1]
        if len(prefixed) == 1:
            return prefixed[0]
    return None


class BaseSource:
    """The checkpoint's unsaved frozen weights ``names`` from ``base_dir``, every one checked
    against ``record`` (the manifest's ``frozen`` entry); ValueError naming what differs."""

    def __init__(self, base_dir: str, names: list[str], record: dict, where: str) -> None:
        self.readers: dict[str, RangeReader] = {}
        self.tensors: dict[str, BaseTensor] = {}
        try:
            self._check(base_dir, names, record, where)
        except BaseException:
            self.close()
            raise

    def _check(self, base_dir: str, names: list[str], record: dict, where: str) -> None:
        if record.get("method", frozen_base.METHOD) != frozen_base.METHOD:
            raise ValueError(f"{where} records its base by digest method {record.get('method')!r}; this zeroshard "
                             f"computes {frozen_base.METHOD!r} and cannot check base={base_dir!r} against it")
        files = weight_map(base_dir)
        absent, wrong = [], []
        for name in names:
            want = record["tensors"][name]
            stored = _stored_name(name, set(files))
            dtype = DTYPES.get(want.get("dtype"))
            if stored is None or dtype is None:
                absent.append(name)
                continue
            reader = self._reader(files[stored])
            if list(reader.shape(stored)) != list(want["shape"]):
                wrong.append(f"{name}: checkpoint {want['shape']} vs {stored!r} {reader.shape(stored)}")
                continue
            t = BaseTensor(files[stored], stored, dtype, tuple(want["shape"]))
            have = frozen_base.streamed_digest(functools.partial(self._read, t), math.prod(t.shape), _CHUNK)
            if have != want["digest"]:
                wrong.append(f"{name} ({stored!r}): values differ (digest {want['digest']} vs {have})")
                continue
            self.tensors[name] = t
        if absent or wrong:
            parts = ([f"not in it: {absent[:5]}{' ...' if len(absent) > 5 else ''}"] if absent else []) + wrong[:5]
            raise ValueError(f"base={base_dir!r} is not the base {where} was trained on ({len(absent) + len(wrong)} "
                             f"of {len(names)} frozen weights: {'; '.join(parts)}{' ...' if len(wrong) > 5 else ''}); "
                             "pass the directory of the base model it was trained from")

    def _reader(self, path: str) -> RangeReader:
        if path not in self.readers:
            self.readers[path] = RangeReader(path)
        return self.readers[path]

    def _read(self, t: BaseTensor, a: int, b: int) -> torch.Tensor:
        return self._reader(t.file).read(t.stored, a, b).to(t.dtype)

    def chunks(self, name: str, out: torch.dtype) -> Iterator[memoryview]:
        """The bytes of frozen weight ``name`` in ``out`` dtype, a chunk at a time."""
        t = self.tensors[name]
        numel = math.prod(t.shape)
        for a in range(0, numel, _CHUNK):
            yield tensor_bytes(self._read(t, a, min(numel, a + _CHUNK)).to(out))

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()
