"""Trainer state (scheduler, data position, RNG, extra) as JSON, never pickle.

``state_dict()`` of schedulers and samplers holds ints, floats, strings, lists, tuples,
dicts and sometimes small tensors. They round-trip exactly: Python's float repr is exact,
tuples and tensors are tagged objects, and anything else is refused at save time with
the path of the offending value (so a lambda in a scheduler's state says where it is).
"""
from __future__ import annotations

import base64
from typing import Any

import torch

from zeroshard.checkpoint.shard_file import CODES, DTYPES

_TAG = "__zeroshard__"


def encode(obj: Any, path: str = "state") -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {_TAG: "tuple", "items": items}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            bad = next(k for k in obj if not isinstance(k, (str, int)))
            raise TypeError(f"{path} has a key {bad!r} of type {type(bad).__name__}; only str/int keys are stored")
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode(v, f"{path}[{k!r}]") for k, v in obj.items()}
        return {_TAG: "dict", "items": [[k, encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype not in CODES:
            raise TypeError(f"{path} is a tensor of dtype {t.dtype}, which cannot be stored")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TAG: "tensor", "dtype": CODES[t.dtype], "shape": list(t.shape),
                "data": base64.b64encode(raw).decode()}
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # numpy scalars and arrays (numpy RNG)
        return encode(obj.tolist(), path)
    raise TypeError(f"{path} is a {type(obj).__name__}, which is not JSON-serialisable; checkpoints "
                    "store no pickle: keep state_dict() values to numbers, strings, lists, dicts, tensors")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in obj.items()}
    if tag == "tuple":
        return tuple(decode(v) for v in obj["items"])
    if tag == "dict":
        return {k: decode(v) for k, v in obj["items"]}
    if tag == "tensor":
        dtype = DTYPES[obj["dtype"]]
        raw = bytearray(base64.b64decode(obj["data"]))
        shape = [int(d) for d in obj["shape"]]
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(shape).clone()
    raise ValueError(f"unknown tagged value {tag!r} in checkpoint state")
