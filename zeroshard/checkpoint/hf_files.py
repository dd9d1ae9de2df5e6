"""Reading Hugging Face safetensors weights: which file holds each tensor (``weight_map``), PEFT's
names for a base model's tensors, and byte ranges of one file without a memory map (``RangeReader``).
Shared by ``load_safetensors`` (zeroshard/model/) and the exports' frozen-base reads."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from zeroshard.checkpoint.shard_file import COMPLEX_DTYPES, DTYPES


def weight_map(path: str) -> dict[str, str]:
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
        return weight_map(single)
    raise FileNotFoundError(f"{path} holds neither model.safetensors.index.json nor model.safetensors")


def peft_base_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


class RangeReader:
    """Reads byte ranges of the tensors of one safetensors file with ``os.pread``: exactly the
    elements a rank owns, with no memory map (a mapped file's touched pages count as the
    process's resident memory). The header is checked against the file before it is used."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise ValueError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        header = json.loads(os.pread(self.fd, n, 8))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, list[int], int]] = {}
        for name, e in header.items():
            dtype = DTYPES.get(e.get("dtype")) or COMPLEX_DTYPES.get(e.get("dtype"))  # (C64: export_hf's complex)
            a, b = e.get("data_offsets", (-1, -1))
            shape = [int(d) for d in e.get("shape", [])]
            numel = 1
            for d in shape:
                numel *= d
            if dtype is None or not 0 <= a <= b <= size - self.base or b - a != numel * dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} has an invalid header entry {e}")
            self.entries[name] = (dtype, shape, self.base + a)

    def shape(self, name: str) -> list[int]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        dtype, _, offset = self.entries[name]
        nbytes = (stop - start) * dtype.itemsize
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + start * dtype.itemsize + done)
            if got <= 0:
                raise ValueError(f"{self.path}: short read of {name!r}")
            done += got
        return torch.frombuffer(buf, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)

    def close(self) -> None:
        os.close(self.fd)
