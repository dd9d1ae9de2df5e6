"""Optimizer state of any shape on NVMe: the runs that are not stepped by the fused Adam kernel.

Note [generic state on NVMe]: ``NvmeOptimizerState`` streams Adam's two flat moments; a
whole-tensor class (Muon's momentum, Adafactor's row and column factors) or another
elementwise class keeps state of its own keys, shapes and dtypes. Its layout is learnt at
construction by stepping a zero copy of each distinct (group, shape, dtype) once with the
group's class and options (``probe_layouts``), so that every run's region in the swap file is
reserved before the first step, as Adam's is: a disk too small fails at construction. Tensors
with more than one element live in the file, each key in its own aligned range of the run's
region; 0-dim tensors (Adafactor's ``step``) and non-tensors stay in memory, as Adam's step
counts do. The step updates one run at a time with the class's own ``step``: its state read
into an aligned buffer, the class given that one parameter and its state (the other groups
emptied for the moment), the new state written back behind it. Runs whose state automatic
placement keeps in memory hold it in a plain dict.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from zeroshard.io import aligned_empty
from zeroshard.offload.swap_file import aligned


class Pending(Protocol):
    """A read or write in flight (the swap file's)."""

    def wait(self) -> object: ...


class RunLike(Protocol):
    @property
    def group(self) -> int: ...

    @property
    def tensor(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class KeyLayout:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Bytes from the start of the run's region (aligned)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class GenericRun:
    """How one run is stepped and where its state lives."""

    part: torch.optim.Optimizer
    """The inner optimizer of its class (one of GroupedInner's parts)."""
    group: int
    """Its group's index in ``part.param_groups``."""
    keys: tuple[KeyLayout, ...]

    @property
    def region_bytes(self) -> int:
        return max((aligned(k.offset + k.nbytes) for k in self.keys), default=0)


def _layout(state: dict) -> tuple[KeyLayout, ...]:
    out, offset = [], 0
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out.append(KeyLayout(key, tuple(v.shape), v.dtype, offset))
            offset = aligned(offset + out[-1].nbytes)
    return tuple(out)


def probe_layouts(parts: list[tuple[torch.optim.Optimizer, list[int]]], runs: Sequence[RunLike],
                  generic: Callable[[torch.optim.Optimizer], bool]) -> dict[int, GenericRun]:
    """``id(run.tensor)`` -> its ``GenericRun``, for the runs of the parts ``generic`` selects:
    each distinct (part, group, shape, dtype) stepped once on zeros by a fresh instance of the
    part's class with the group's options, its state's tensors read for their shapes."""
    out: dict[int, GenericRun] = {}
    seen: dict[tuple, tuple[KeyLayout, ...]] = {}
    for part, indices in parts:
        if not generic(part):
            continue
        for gi, user_index in enumerate(indices):
            group = part.param_groups[gi]
            for run in (r for r in runs if r.group == user_index):
                t = run.tensor
                key = (id(part), gi, tuple(t.shape), t.dtype)
                if key not in seen:
                    probe = torch.zeros(t.shape, dtype=t.dtype)
                    probe.grad = torch.zeros_like(probe)
                    options = {k: v for k, v in group.items() if k != "params"}
                    scratch = type(part)([{**options, "params": [probe]}])  # type: ignore[call-arg]
                    scratch.step()
                    seen[key] = _layout(scratch.state[probe])
                out[id(t)] = GenericRun(part, gi, seen[key])
    return out


class GenericRecords:
    """The state of the generic runs: regions in the swap file (``file_offset`` maps a run to
    its region) or, for ``resident`` runs, dicts in memory; scalars always in memory."""

    def __init__(self, runs: dict[int, GenericRun], file_offset: dict[int, int],
                 read: Callable[[torch.Tensor, int], Pending], write: Callable[[torch.Tensor, int], Pending],
                 step_fn: Callable[[torch.optim.Optimizer], object]) -> None:
        """``step_fn(part)``: the part's step without torch's step hooks (optim/inner.py)."""
        self.runs = runs
        self._step_fn = step_fn
        self.file_offset = file_offset
        self._read, self._write = read, write
        self.scalars: dict[int, dict] = {}
        """Per run with state: its 0-dim tensors and non-tensors."""
        self.resident: dict[int, dict] = {}
        """Tensor state of the runs kept in memory."""

    def __contains__(self, t: torch.Tensor) -> bool:
        return id(t) in self.runs

    def has_state(self, t: torch.Tensor) -> bool:
        return id(t) in self.scalars

    def elementwise_keys(self, t: torch.Tensor) -> tuple[str, ...]:
        return tuple(k.key for k in self.runs[id(t)].keys if k.shape == tuple(t.shape))

    def dtype(self, t: torch.Tensor, key: str) -> torch.dtype:
        return next(k.dtype for k in self.runs[id(t)].keys if k.key == key)

    def _views(self, t: torch.Tensor, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k.key: buf[k.offset:k.offset + k.nbytes].view(k.dtype).view(k.shape) for k in self.runs[id(t)].keys}

    def read(self, t: torch.Tensor, tensors_only: bool = False) -> dict:
        """The run's whole state (tensors read from the file), or {} before its first step."""
        return self._read_into(t, tensors_only)[0]

    def _read_into(self, t: torch.Tensor, tensors_only: bool = False) -> tuple[dict, Optional[torch.Tensor]]:
        """``read``, and the buffer its tensors are views of (None when kept in memory or empty)."""
        if id(t) not in self.scalars:
            return {}, None
        buf = None
        if id(t) in self.resident:
            tensors = {k: v.clone() for k, v in self.resident[id(t)].items()}
        else:
            buf = aligned_empty(self.runs[id(t)].region_bytes)
            self._read(buf, self.file_offset[id(t)]).wait()
            tensors = self._views(t, buf)
        return (tensors if tensors_only else {**self.scalars[id(t)], **tensors}), buf

    def write(self, t: torch.Tensor, state: dict, wait: bool = True,
              buf: Optional[torch.Tensor] = None) -> Optional[Pending]:
        """Stores ``state`` (every key of the run's layout; the rest kept as scalars). ``buf``: a
        region buffer that already holds the tensors (updated in place), written as it is."""
        layout = self.runs[id(t)]
        missing = [k.key for k in layout.keys if k.key not in state]
        if missing:
            raise ValueError(f"optimizer state for a run of shape {tuple(t.shape)} lacks {missing} "
                             f"(its class {type(layout.part).__name__} keeps {[k.key for k in layout.keys]})")
        names = {k.key for k in layout.keys}
        self.scalars[id(t)] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in state.items() if k not in names}
        if id(t) in self.file_offset:
            if buf is None:
                buf = aligned_empty(layout.region_bytes)
                for k, view in self._views(t, buf).items():
                    view.copy_(state[k].reshape(view.shape))
            pending = self._write(buf, self.file_offset[id(t)])
            if wait:
                pending.wait()
                return None
            return pending
        self.resident[id(t)] = {k.key: state[k.key].detach().clone().reshape(k.shape) for k in layout.keys}
        return None

    def forget(self, t: torch.Tensor) -> None:
        self.scalars.pop(id(t), None)
        self.resident.pop(id(t), None)

    @torch.no_grad()
    def step(self, t: torch.Tensor, grad_scale: float) -> Optional[Pending]:
        """The class's own update of one run (its gradient scaled by a pending clip
        coefficient); returns the pending write of its new state."""
        layout = self.runs[id(t)]
        part, group = layout.part, layout.part.param_groups[layout.group]
        if grad_scale != 1.0 and t.grad is not None:
            t.grad.mul_(grad_scale)
        saved_state, saved_params = part.state, [g["params"] for g in part.param_groups]
        state, buf = self._read_into(t)
        views = {k.key: state[k.key] for k in layout.keys} if buf is not None else {}
        try:
            part.state = defaultdict(dict)
            if state:
                part.state[t] = state
            for g in part.param_groups:
                g["params"] = [t] if g is group else []
            self._step_fn(part)
            new = part.state[t]
        finally:
            part.state = saved_state
            for g, params in zip(part.param_groups, saved_params):
                g["params"] = params
        # (a class that updates its state in place, as Muon and Adafactor do, left the new state
        # in the buffer read: written as it is, without a second buffer and copy)
        in_place = bool(views) and all(new.get(k) is v for k, v in views.items())
        return self.write(t, new, wait=False, buf=buf if in_place else None)
