"""Reading DeepSpeed's ``.pt`` files without running pickled code.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (a pickle) and one raw byte
record per storage (``<name>/data/<key>``). Unpickling runs whatever callables the pickle
names, so ``RestrictedUnpickler.find_class`` admits only:

- the functions that rebuild tensors (``torch._utils._rebuild_tensor_v2``,
  ``_rebuild_parameter``, ``torch._tensor._rebuild_from_type_v2``) -- replaced by our own,
  which check their arguments and build a tensor over the archive's bytes, nothing else;
- storage types (``torch.FloatStorage`` ...), ``torch.Size``, ``torch.device``, dtypes,
  ``collections.OrderedDict`` and plain containers (``set``, ``frozenset``);
- a few DeepSpeed objects that hold only data (``STAND_INS``: its loss scaler, ZeRO stage
  enum, fragment addresses, the ``argparse.Namespace`` of ``args``) -- as ``StandIn``
  records of their constructor arguments and state, never the class itself (deepspeed is
  never imported).

Anything else raises ``pickle.UnpicklingError`` naming the class, before it is called. The
storages' bytes are read from the archive by key (a decimal number, never a path), with
their size checked against the element count the pickle claims.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from typing import IO, Any, Callable, Optional

import torch

STAND_INS = frozenset({
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleState",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.config.DeepSpeedConfig",
    "argparse.Namespace",
})
"""Classes read as ``StandIn`` records (full dotted names)."""

_STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "UntypedStorage": torch.uint8,
}
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "float", "double", "half", "long", "int"}
MAX_PICKLE_BYTES = 256 << 20
"""The pickle of a checkpoint file describes tensors; its data lives in the storage records."""
MAX_NODES = 1 << 22
"""Values a file's object may hold, counted as a walk meets them (a shared one each time): a
pickle's memo lets a few hundred bytes name a list of 2**40 leaves, which every later walk
(the converter's, JSON's) would expand; real checkpoints hold thousands."""
MAX_DEPTH = 256


class StandIn:
    """A DeepSpeed object read as data: ``args`` (what its class was called with) and
    ``state`` (what would have been set on it). Attribute reads look in ``state``."""

    ds_class = "?"

    def __new__(cls, *args: object, **kwargs: object) -> "StandIn":
        obj = object.__new__(cls)
        object.__setattr__(obj, "args", args)
        object.__setattr__(obj, "state", dict(kwargs))
        return obj

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass  # (__new__ recorded the arguments; nothing of the real class runs)

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            merged: dict = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        self.state.update(state if isinstance(state, dict) else {"state": state})

    def __getattr__(self, name: str) -> Any:
        state = object.__getattribute__(self, "state")
        if name in state:
            return state[name]
        raise AttributeError(f"{self.ds_class} (read as data) has no field {name!r}")

    @property
    def value(self) -> Any:
        """An enum's value (``ZeroStageEnum(3)`` pickles as the class called with 3)."""
        return self.args[0] if self.args else self.state.get("value")

    def __repr__(self) -> str:
        return f"StandIn({self.ds_class}, args={self.args!r}, state={self.state!r})"


_STAND_IN_CLASSES: dict[str, type] = {}


def _stand_in(full: str) -> type:
    if full not in _STAND_IN_CLASSES:
        _STAND_IN_CLASSES[full] = type(full.rsplit(".", 1)[1], (StandIn,), {"ds_class": full})
    return _STAND_IN_CLASSES[full]


class _StorageType:
    """What ``torch.FloatStorage`` & co. stand for in a pickle: the element type."""

    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, _STORAGES[name]


class _TensorType:
    """``torch.Tensor`` / ``torch.nn.Parameter`` as the type argument of a rebuild."""


def _check_ints(what: str, values: object) -> tuple:
    if not isinstance(values, (tuple, list, torch.Size)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise pickle.UnpicklingError(f"a tensor's {what} is {values!r}, not a tuple of non-negative ints")
    return tuple(values)


def _rebuild_tensor(storage: object, offset: object, size: object, stride: object, requires_grad: object = False,
                    backward_hooks: object = None, metadata: object = None) -> torch.Tensor:
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor's storage is a {type(storage).__name__}, not a storage")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise pickle.UnpicklingError(f"a tensor's storage offset is {offset!r}")
    size, stride = _check_ints("size", size), _check_ints("stride", stride)
    if len(size) != len(stride):
        raise pickle.UnpicklingError(f"a tensor's size {size} and stride {stride} differ in length")
    if backward_hooks:  # (hooks are callables: a tensor file has none)
        raise pickle.UnpicklingError("a tensor in the file carries backward hooks; refusing it")
    t = torch.empty((0,), dtype=storage.dtype)
    try:  # (set_ checks that the view stays inside the storage)
        return t.set_(storage._untyped_storage, offset, size, stride)
    except RuntimeError as exc:
        raise pickle.UnpicklingError(f"a tensor does not fit its storage: {exc}") from None


def _rebuild_parameter(data: object, requires_grad: object = False, backward_hooks: object = None) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError(f"a parameter's data is a {type(data).__name__}, not a tensor")
    return data


def _rebuild_from_type(func: object, new_type: object, args: object, state: object = None) -> torch.Tensor:
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(new_type, _TensorType) or \
            not isinstance(args, tuple):
        raise pickle.UnpicklingError("a tensor subclass rebuild that is not torch.Tensor's; refusing it")
    return func(*args)  # (state: attributes set on the tensor; none matter to a checkpoint reader)


_TENSOR_TYPE = _TensorType()
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TENSOR_TYPE,
    ("torch.nn.parameter", "Parameter"): _TENSOR_TYPE,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles tensors, plain containers and ``STAND_INS`` only (see the module docstring).
    ``storage(key, dtype, numel)`` returns the bytes of a storage record."""

    def __init__(self, file: IO[bytes], storage: Callable[[str, torch.dtype, int], torch.storage.TypedStorage]) -> None:
        super().__init__(file)
        self._storage = storage
        self._cache: dict[str, torch.storage.TypedStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        full = f"{module}.{name}"
        if full in STAND_INS:
            return _stand_in(full)
        raise pickle.UnpicklingError(f"refusing to unpickle {full}: a checkpoint file may hold only tensors and "
                                     "plain containers (running a pickled class could run any code)")

    def persistent_load(self, pid: object) -> torch.storage.TypedStorage:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}; not a torch.save file")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not key.isdigit() or \
                not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage reference {pid!r:.120}")
        if key not in self._cache:
            self._cache[key] = self._storage(key, kind.dtype, numel)
        cached = self._cache[key]
        if cached.dtype != kind.dtype:
            raise pickle.UnpicklingError(f"storage {key} is referenced as {kind.dtype} and as {cached.dtype}")
        return cached


def load_pt(path: str, max_bytes: Optional[int] = None) -> Any:
    """The object ``torch.save`` wrote to ``path`` (zip format), read with
    ``RestrictedUnpickler``; tensors are CPU tensors over the file's bytes."""
    if not os.path.isfile(path) or os.path.islink(path):
        raise ValueError(f"{path} is not a regular file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip-format torch.save file (the legacy format, torch<1.6, is not read)")
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one <name>/data.pkl record, found {len(pickles)}")
        prefix = pickles[0][:-len("data.pkl")]
        order = prefix + "byteorder"
        if order in names and zf.read(order).strip() not in (b"little",):
            raise ValueError(f"{path} was written on a big-endian machine; it is not read here")
        info = zf.getinfo(pickles[0])
        _check_record(path, info)
        if info.file_size > MAX_PICKLE_BYTES:
            raise ValueError(f"{path}: its pickle is {info.file_size} bytes; a checkpoint's is far smaller")
        data = zf.read(pickles[0])

        def storage(key: str, dtype: torch.dtype, numel: int) -> torch.storage.TypedStorage:
            record = f"{prefix}data/{key}"
            try:
                entry = zf.getinfo(record)
            except KeyError:
                raise pickle.UnpicklingError(f"{path}: storage record {record} is missing") from None
            _check_record(path, entry)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if entry.file_size != numel * itemsize or (max_bytes is not None and entry.file_size > max_bytes):
                raise pickle.UnpicklingError(f"{path}: storage {key} has {entry.file_size} bytes, the pickle says "
                                             f"{numel} x {itemsize}")
            raw = bytearray(zf.read(record))
            untyped = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if raw else torch.UntypedStorage(0)
            return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

        loaded = RestrictedUnpickler(io.BytesIO(data), storage).load()
    bound_walk(loaded, path)
    return loaded


def _check_record(path: str, entry: zipfile.ZipInfo) -> None:
    """Before a record is read: stored as torch.save stores it (no compression, whose few bytes
    can inflate to gigabytes), and no larger than the file that holds it."""
    if entry.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: record {entry.filename} is compressed (method {entry.compress_type}); "
                         "torch.save stores records uncompressed, so this is not a file it wrote")
    size = os.path.getsize(path)
    if entry.file_size > size or entry.compress_size != entry.file_size:
        raise ValueError(f"{path}: record {entry.filename} claims {entry.file_size} bytes in a file of {size}; "
                         "the archive is damaged or forged")


def bound_walk(obj: object, path: str) -> None:
    """Refuses an object whose walk (shared values counted each time they are met) exceeds
    ``MAX_NODES`` values or ``MAX_DEPTH`` levels, before any consumer walks it."""
    budget = MAX_NODES
    stack: list[tuple[object, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        budget -= 1
        if budget < 0 or depth > MAX_DEPTH:
            raise ValueError(f"{path}: its pickle holds more than {MAX_NODES} values or nests deeper than "
                             f"{MAX_DEPTH} (a memo bomb: a few bytes naming the same list again and again); "
                             "not read")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for kv in value.items() for v in kv)
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, StandIn):
            stack.extend((v, depth + 1) for v in (value.args, value.state))
