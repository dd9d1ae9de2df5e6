"""Trainer state (scheduler, data position, RNG, extra) as JSON, never pickle.

``state_dict()`` of schedulers and samplers holds ints, floats, strings, lists, tuples,
dicts and sometimes small tensors. They round-trip exactly: Python's float repr is exact,
tuples and tensors are tagged objects, and anything else is refused at save time with
the path of the offending value (so a lambda in a scheduler's state says where it is).
"""
from __future__ import annotations

import base64
import math
from typing import Any

import torch

from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.safe_fs import MAX_JSON_DEPTH
from zeroshard.checkpoint.shard_file import CODES, DTYPES

_TAG = "__zeroshard__"


def encode(obj: Any, path: str = "state", depth: int = 0) -> Any:
    if depth > MAX_JSON_DEPTH:  # the loader refuses deeper values: refuse them at save time
        raise TypeError(f"{path} is nested more than {MAX_JSON_DEPTH} levels deep; checkpoints refuse "
                        "deeper state (a loader could not tell it from a malformed file)")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {_TAG: "tuple", "items": items}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            bad = next(k for k in obj if not isinstance(k, (str, int)))
            raise TypeError(f"{path} has a key {bad!r} of type {type(bad).__name__}; only str/int keys are stored")
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode(v, f"{path}[{k!r}]", depth + 1) for k, v in obj.items()}
        return {_TAG: "dict", "items": [[k, encode(v, f"{path}[{k!r}]", depth + 1)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype not in CODES:
            raise TypeError(f"{path} is a tensor of dtype {t.dtype}, which cannot be stored")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TAG: "tensor", "dtype": CODES[t.dtype], "shape": list(t.shape),
                "data": base64.b64encode(raw).decode()}
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # numpy scalars and arrays (numpy RNG)
        return encode(obj.tolist(), path, depth)
    raise TypeError(f"{path} is a {type(obj).__name__}, which is not JSON-serialisable; checkpoints "
                    "store no pickle: keep state_dict() values to numbers, strings, lists, dicts, tensors")


def _bad(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: {what}; the checkpoint's state is malformed")


def decode(obj: Any, path: str = "state", depth: int = 0) -> Any:
    """The value ``encode`` stored. Checkpoint JSON is untrusted: anything ``encode`` cannot
    have written (an unknown tag, a tensor whose bytes do not match its shape, nesting
    deeper than MAX_JSON_DEPTH) raises CheckpointCorruptError naming where it is."""
    if depth > MAX_JSON_DEPTH:
        raise _bad(path, f"nested more than {MAX_JSON_DEPTH} levels deep")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise _bad(path, f"a {type(obj).__name__} is not a JSON value")
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode(v, f"{path}[{k!r}]", depth + 1) for k, v in obj.items()}
    items = obj.get("items")
    if tag == "tuple":
        if not isinstance(items, list):
            raise _bad(path, "a tuple without an 'items' list")
        return tuple(decode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(items))
    if tag == "dict":
        if not isinstance(items, list) or not all(
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) for kv in items):
            raise _bad(path, "a dict whose 'items' are not [key, value] pairs with str/int keys")
        return {k: decode(v, f"{path}[{k!r}]", depth + 1) for k, v in items}
    if tag == "tensor":
        return _decode_tensor(obj, path)
    raise _bad(path, f"unknown tagged value {tag!r} (checkpoints store no pickle or objects)")


def _decode_tensor(obj: dict, path: str) -> torch.Tensor:
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shape, list) or \
            not isinstance(data, str) or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 31 for d in shape):
        raise _bad(path, f"a tensor with dtype {dtype!r}, shape {shape!r} and data of type {type(data).__name__}")
    numel = math.prod(shape)
    want = numel * DTYPES[dtype].itemsize
    if len(data) != 4 * (-(-want // 3)):  # base64 length, checked before decoding anything
        raise _bad(path, f"a {dtype} tensor of shape {shape} holds {len(data)} base64 characters, "
                         f"not the {4 * (-(-want // 3))} its {want} bytes need")
    try:
        raw = bytearray(base64.b64decode(data, validate=True))
    except (ValueError, TypeError):
        raise _bad(path, "a tensor whose data is not base64") from None
    if len(raw) != want:
        raise _bad(path, f"a tensor of {len(raw)} bytes where shape {shape} needs {want}")
    flat = torch.frombuffer(raw, dtype=DTYPES[dtype]) if raw else torch.empty(0, dtype=DTYPES[dtype])
    return flat.reshape(shape).clone()
