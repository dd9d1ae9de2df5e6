"""Which kernel runs each param group, and the inner optimizer(s) over this rank's runs; NVMe
streaming refuses a group the fused kernel does not run (``check_nvme_kernel``).

torch.optim.Adam/AdamW run on ``zeroshard.ops.FusedAdam`` when it computes the same thing;
the choice is made per param group, from the group's own options merged over the
constructor's, because torch reads every option per group (a group's ``amsgrad=True`` or
``decoupled_weight_decay=True`` is honoured by torch.optim.Adam even when the constructor
said otherwise). Groups the kernel cannot reproduce stay on the user's class; when both
kinds exist the inner optimizer is a ``GroupedInner`` of one FusedAdam and one instance of
the user's class, sharing one state mapping so state I/O sees a single ``inner.state``.

Note [one run per parameter]: the inner optimizer gets one tensor (a run) per parameter's
owned piece, a view of the flat master and gradient, as torch.optim gets one per parameter.
torch skips a parameter whose ``.grad`` is None (frozen for some steps, unused this step):
no update, no step count. With one run per unit and group, a run holding such a parameter
beside others that got gradients was stepped whole, so the parameter's Adam ``step`` counted
the step and its values had to be saved and put back around the step. Per parameter, the step
simply leaves its run out (``untouched.skip_whole_runs``), exactly as torch. The fused kernel
takes the runs as a list of tensors, so the flat buffers stay contiguous for the collectives.
Under NVMe streaming (``offload_optimizer="nvme"``, or automatic placement that streams) state
moves run by run in aligned regions, so runs stay one per unit and group there; that path
puts the untouched parameters of a stepped run back after the kernel (their values and moments: Note
[untouched parts of a streamed run] in zeroshard/offload/nvme_state.py); what it cannot give them is a
step count of their own (one per run).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional, Sequence

import torch

from zeroshard.config import ZeroConfig
from zeroshard.ops import FusedAdam
from zeroshard.units.run import Run
from zeroshard.units.elementwise import update_kind
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.optim.inner import GroupedInner, normalize_state, step_without_hooks  # noqa: F401

# torch.optim.Adam/AdamW options the fused kernel reproduces exactly (per group).
_FUSABLE = {"lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay", "amsgrad",
            "foreach", "fused", "capturable", "differentiable", "initial_lr", "param_names"}
# Options whose default value (False/None) the kernel matches, any other value it does not.
_OFF_ONLY = ("amsgrad", "foreach", "fused", "capturable", "differentiable")


def _fusable(options: dict) -> bool:
    if set(options) - _FUSABLE:
        return False
    if any(options.get(k) not in (None, False) for k in _OFF_ONLY):
        return False
    betas = options.get("betas")
    # Tensor betas/lr are read once per step as numbers: the kernel gives the same result.
    return betas is None or len(betas) == 2


def group_class(group: dict, default: type) -> type:
    """The optimizer class of a param group: its ``"optimizer_class"`` key, else the constructor's."""
    return group.get("optimizer_class", default)


def choose_kernels(optimizer_class: type, kwargs: dict, groups: list[dict], enabled: bool) -> list[bool]:
    """Per param group: True when it runs on FusedAdam (its class Adam/AdamW with options the
    kernel reproduces; the constructor's keywords belong to the constructor's class)."""
    out = []
    for g in groups:
        cls = group_class(g, optimizer_class)
        base = kwargs if cls is optimizer_class else {}
        out.append(enabled and cls in (torch.optim.Adam, torch.optim.AdamW)
                   and _fusable({**base, **{k: v for k, v in g.items() if k not in ("params", "optimizer_class")}}))
    return out


def _fused_options(optimizer_class: type[torch.optim.Optimizer], options: dict) -> dict:
    """torch.optim.Adam/AdamW options as FusedAdam's (``adamw_mode`` from decoupling)."""
    defaults = inspect.signature(optimizer_class.__init__).parameters
    decoupled = options.get("decoupled_weight_decay", optimizer_class is torch.optim.AdamW)
    out = {"weight_decay": defaults["weight_decay"].default,
           **{k: v for k, v in options.items() if k in ("lr", "betas", "eps", "weight_decay", "maximize")},
           "adamw_mode": bool(decoupled)}
    return out


KERNEL_KEYS = ("adamw_mode",)  # FusedAdam's own, derived per step from the user class's options


def shown_options(optimizer_class: type, options: dict) -> dict:
    """A group's options as torch code sees them (``param_groups``, torch's state-dict API): the
    kernel's keys only where the user's class takes them, so a ZeroOptimizer over AdamW has
    AdamW's keys and an FSDP2 checkpoint of AdamW has every key its groups ask for."""
    try:
        takes = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):  # (no signature to read: every key is shown, as before)
        return dict(options)
    return {k: v for k, v in options.items() if k not in KERNEL_KEYS or k in takes}


def sync_fused_group(group: dict) -> None:
    """A fused group follows a user's change of ``decoupled_weight_decay`` (torch reads it per step)."""
    if "decoupled_weight_decay" in group:
        group["adamw_mode"] = bool(group["decoupled_weight_decay"])


def _runs(units: list[FlatUnit], whole: list[bool], per_parameter: bool) -> list[Run]:
    """This rank's runs: per unit, one per parameter's owned piece (``per_parameter``: Note
    [one run per parameter]) or one per param group over the owned range; for a group whose
    optimizer reads whole tensors, one per parameter shaped as it (Note [whole-tensor units] in
    layout/bucketing.py: the owned range holds such parameters whole)."""
    out = []
    for unit in units:
        with unit.swap.sized(unit) if unit.swap is not None else contextlib.nullcontext():
            for g, a, b in unit.layout.group_runs(*unit.owned):
                spans = [(a, b, None)] if not (whole[g] or per_parameter) else [
                    (p.unit_offset, p.unit_offset + p.numel, p if whole[g] else None)
                    for p in unit.layout.pieces_in(a, b)]
                for lo, hi, piece in spans:
                    t, grad = unit.master_range(lo, hi), unit.grad_range(lo, hi)
                    if piece is not None:
                        if piece.numel != piece.segment.numel:
                            raise RuntimeError(f"{piece.segment.name!r} is split over ranks, but its group's optimizer "
                                               "reads whole tensors (an owner layout keeps it whole)")
                        t, grad = t.view(piece.segment.shape), grad.view(piece.segment.shape)
                    t.grad = grad
                    out.append(Run(unit, g, lo, hi, t))
    return out


def build_inner(optimizer_class: type, kwargs: dict, groups: list[dict], units: list[FlatUnit],
                enabled: bool, per_parameter: bool = True) -> tuple[list[Run], Any]:
    """The inner optimizer(s) over this rank's runs (``per_parameter``: one per parameter's
    piece, Note [one run per parameter]): one instance per optimizer class and kernel (a
    ``GroupedInner`` when there are several), each group on its own class."""
    classes = [group_class(g, optimizer_class) for g in groups]
    whole = [update_kind(c) == "whole" for c in classes]
    all_runs = _runs(units, whole, per_parameter)
    device, dtype = units[0].master.device, units[0].master.dtype
    # The kernel updates fp32 masters; float64 state stays on torch's own implementation.
    fused = choose_kernels(optimizer_class, kwargs, groups, enabled and dtype == torch.float32)
    parts: list[tuple[torch.optim.Optimizer, list[int]]] = []
    for key in dict.fromkeys(zip(classes, fused)):  # (in group order)
        cls, want_fused = key
        indices = [i for i, k in enumerate(zip(classes, fused)) if k == key]
        base = kwargs if cls is optimizer_class else {}  # (the constructor's keywords are its class's)
        inner_groups = []
        for i in indices:
            # A rank may own nothing of a group; an empty tensor keeps the group (and its
            # hyperparameters) aligned with the user's, and is skipped since it has no grad.
            params = [r.tensor for r in all_runs if r.group == i] or [
                torch.empty((0, 0) if whole[i] else (0,), device=device, dtype=dtype)]
            hp = {k: v for k, v in groups[i].items() if k not in ("params", "param_names", "optimizer_class")}
            if want_fused:  # the group's own decoupling, which FusedAdam's defaults would override
                hp = _fused_options(cls, {**base, **hp})
                hp["decoupled_weight_decay"] = hp["adamw_mode"]
            inner_groups.append({**hp, "params": params})
        run_cls, kw = (FusedAdam, _fused_options(cls, base)) if want_fused else (cls, base)
        try:
            parts.append((run_cls(inner_groups, **kw), indices))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{run_cls.__name__}(**{kw}) over param group(s) {indices} failed: {exc}") from exc
    if len(parts) == 1:
        return all_runs, parts[0][0]
    # The facade's defaults fill missing keys of every user group (torch.optim's add_param_group):
    # only the keys all classes share, so no group shows another class's options (Muon's
    # ns_steps on an AdamW group); each group already holds its own class's.
    shared = set.intersection(*(set(opt.defaults) for opt, _ in parts))
    user_part = next((opt for opt, idx in parts if classes[idx[0]] is optimizer_class), parts[0][0])
    return all_runs, GroupedInner(parts, len(groups), {k: v for k, v in user_part.defaults.items() if k in shared})


def fused_part(inner: Any) -> Optional[torch.optim.Optimizer]:
    """The FusedAdam running every group, or None (no group, or only some groups, fused)."""
    return inner if isinstance(inner, FusedAdam) else None


def nvme_kernel_refusal(optimizer_class: type, kwargs: dict, groups: Sequence[dict] = (),
                        fused: Sequence[bool] = ()) -> ValueError:
    """Names the first elementwise param group the NVMe stream cannot carry (whole-tensor
    classes stream their own state: Note [generic state on NVMe])."""
    off = [(i, g.get("optimizer_class", optimizer_class)) for i, (g, ok) in enumerate(zip(groups, fused))
           if not ok and update_kind(g.get("optimizer_class", optimizer_class)) == "elementwise"]
    cls = off[0][1] if off else optimizer_class
    where = f"param group {off[0][0]}: " if len(groups) > 1 and off else ""
    options = kwargs if cls is optimizer_class else {}
    return ValueError(
        f"{where}offload_optimizer='nvme' streams elementwise state as Adam/AdamW moments through the fused kernel; "
        f"{getattr(cls, '__name__', cls)}(**{options}) does not run on it (use torch.optim.Adam or AdamW without "
        "amsgrad/foreach/fused/capturable, a whole-tensor class such as Muon or Adafactor, or offload_optimizer='cpu')")


def check_nvme_kernel(config: ZeroConfig, optimizer_class: type, kwargs: dict, group_options: list[dict],
                      params: list[torch.Tensor]) -> None:
    """offload_optimizer="nvme" steps every group on the fused kernel: a class, option or dtype
    it does not run is refused here, before any parameter is moved (Note [refused construction]
    in zeroshard/optim/construction.py). ``group_options``: each group's options, no params."""
    if not config.optimizer_swapped:
        return
    float64 = config.mixed_precision is None and any(p.requires_grad and p.dtype == torch.float64 for p in params)
    options = group_options or [{}]
    fused = choose_kernels(optimizer_class, kwargs, options, config.fused_adam and not float64)
    # (whole-tensor classes stream their own state: Note [generic state on NVMe])
    if not all(f or update_kind(g.get("optimizer_class", optimizer_class)) == "whole" for g, f in zip(options, fused)):
        refusal = nvme_kernel_refusal(optimizer_class, kwargs, options, fused)
        if not config.fused_adam or float64:
            why = "fused_adam=False" if not config.fused_adam else "float64 parameters"
            raise ValueError(f"{refusal} ({why}: the kernel is off)")
        raise refusal
