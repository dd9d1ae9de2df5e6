"""What state an optimizer class keeps for a parameter: keys and exact shapes, found by asking it.

Note [state kinds]: a state dict or checkpoint names its state entries, and nothing in it
says they are the state the loading optimizer reads: a Muon matrix handed AdamW's moments, a
transposed momentum buffer, Adafactor's ``row_var`` and ``col_var`` swapped all have the right
element counts and would load and train on wrong state. So every loaded entry is compared
with what the group's own class produces. The class is asked, not described: it takes two
steps on a tiny CPU parameter whose dimensions are distinct primes (2, 3, 5, ...) with the
group's options (less the device flags ``foreach``/``fused``/``capturable``/``differentiable``,
which do not change what is kept), and each state tensor's dimensions are read back as "the
parameter's dimension i", "its element count" or a literal; the template then gives the
expected shape for any parameter of that dimensionality. One probe per class, dimensionality
and option values that can change the kinds kept (a number counts only as zero or not: SGD
keeps no momentum buffer at ``momentum=0``). A class the probe cannot run (a user's that needs
arguments, or refuses the dimensionality: Muon takes matrices only) is not checked beyond the
element counts the loaders check anyway.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Union

import torch

Dim = Union[int, str]  # ("d0", "d1", ...: the parameter's dimension; "numel"; an int: a literal)
Template = tuple[Dim, ...]
_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53)
_DEVICE_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_cache: dict[tuple, Optional[dict[str, Template]]] = {}


def _option_key(hparams: dict) -> tuple:
    def kind(v: object) -> object:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return v != 0
        if isinstance(v, torch.Tensor):
            return bool(v.numel() and v.reshape(-1)[0] != 0)
        if isinstance(v, (list, tuple)):
            return tuple(kind(x) for x in v)
        return type(v).__name__
    return tuple(sorted((k, kind(v)) for k, v in hparams.items() if k not in _DEVICE_FLAGS))


def _template(shape: torch.Size, probe_shape: tuple[int, ...]) -> Template:
    numel = math.prod(probe_shape)
    out: list[Dim] = []
    for d in shape:
        if d in probe_shape and d != 1:
            out.append(f"d{probe_shape.index(d)}")
        elif d == numel and d > 1:
            out.append("numel")
        else:
            out.append(int(d))
    return tuple(out)


def _probe(cls: type, hparams: dict, ndim: int) -> Optional[dict[str, Template]]:
    from zeroshard.optim.inner import step_without_hooks
    shape = _PRIMES[:ndim]
    options = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
               for k, v in hparams.items() if k not in _DEVICE_FLAGS and k not in ("params", "optimizer_class")}
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls([{"params": [p], **options}])
            for i in range(2):
                p.grad = torch.linspace(-1.0, 1.0 + i, max(p.numel(), 1))[:p.numel()].view(shape)
                step_without_hooks(opt)
    except Exception:  # (not a class this check can ask: the loaders' element counts stand)
        return None
    state = opt.state.get(p, {})
    return {k: (() if not isinstance(v, torch.Tensor) else _template(v.shape, shape)) for k, v in state.items()}


def expected_state(cls: type, hparams: dict, shape: tuple[int, ...]) -> Optional[dict[str, tuple[int, ...]]]:
    """Key -> exact shape (``()``: one value, a number or a one-element tensor) of the state
    ``cls`` with options ``hparams`` keeps for a parameter of ``shape``; None where unknown
    (Note [state kinds])."""
    ndim = len(shape)
    if ndim > len(_PRIMES):
        return None
    key = (cls, ndim, _option_key(hparams))
    if key not in _cache:
        _cache[key] = _probe(cls, hparams, ndim)
    templates = _cache[key]
    if templates is None:
        return None
    numel = math.prod(shape)
    return {k: tuple(numel if d == "numel" else shape[int(d[1:])] if isinstance(d, str) else d for d in t)
            for k, t in templates.items()}


def check_entry(param: str, cls: type, got: dict[str, object], expected: Optional[dict[str, tuple[int, ...]]],
                param_shape: tuple[int, ...], flat_numel: Optional[int] = None) -> list[str]:
    """Problems of one parameter's loaded state ``got`` (key -> value, or key -> shape as a
    tuple, or ``...``: the key alone) against ``expected``: keys the class does not keep, keys it keeps that are missing
    (an empty state, saved before the first step, is none), shapes that differ. ``flat_numel``:
    state of the parameter's own shape may come as a flat slice of that many elements (the
    sharded forms store it so, a slice of the flat parameter)."""
    if expected is None or not got:
        return []
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    wrong = []
    for k in sorted(set(got) & set(expected)):
        v, want = got[k], expected[k]
        if v is Ellipsis:  # (a value whose shape the caller cannot tell: its key alone is checked)
            continue
        shape = v if isinstance(v, tuple) else tuple(v.shape) if isinstance(v, torch.Tensor) else None
        if want == ():
            ok = shape is None and isinstance(v, (int, float)) or shape is not None and math.prod(shape) == 1
        else:
            ok = shape == want or flat_numel is not None and shape == (flat_numel,) and want == tuple(param_shape)
        if not ok:
            wrong.append(f"{k!r} has {f'shape {shape}' if shape is not None else repr(v)} where "
                         f"{cls.__name__} keeps shape {want}")
    if not (extra or missing or wrong):
        return []
    parts = ([f"{', '.join(map(repr, extra))} {'is' if len(extra) == 1 else 'are'} not state {cls.__name__} keeps"]
             if extra else []) + \
        ([f"{', '.join(f'{k!r} {expected[k]}' for k in missing)} missing"] if missing else []) + wrong
    return [f"parameter {param!r}: {', '.join(parts)} ({cls.__name__} keeps {_listing(expected)})"]


def _listing(expected: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k} {s}" for k, s in sorted(expected.items())) or "no state"
