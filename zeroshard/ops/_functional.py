"""``adam_step_`` and its list form: validate, route to the CPU/CUDA kernel, else the reference.

Routing rule: a tensor set goes to a native kernel only when that kernel is loaded and the
tensors are exactly what it handles (contiguous; fp32 param and moments; fp32/bf16/fp16
gradient; bf16/fp16 copy-out). Everything else - non-contiguous views, bf16 params, other
devices - runs the pure-PyTorch reference, which is exact but slower. The first time a kernel
that would have been used is missing, one warning says why.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ._loader import REGISTRY
from ._reference import reference_adam_step_

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_F32 = torch.float32


def _check_hyper(step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: float) -> int:
    """Validates the scalars and returns ``step`` as a plain int (numpy ints are accepted)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this step), got {step!r}")
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {(beta1, beta2)!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale!r}")
    return int(step)


def _check_tensors(i: int, p: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None) -> None:
    named = {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v}
    if out is not None:
        named["out_lowp"] = out
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"tensor #{i}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"tensor #{i}: {name} must be floating point, got {t.dtype=}")
        if t.numel() != p.numel():
            raise ValueError(f"tensor #{i}: {name} has {t.numel()} elements ({t.shape=}), "
                             f"param has {p.numel()} ({p.shape=})")
        if t.device != p.device:
            raise ValueError(f"tensor #{i}: {name} is on {t.device}, param on {p.device}")
    if m.dtype != p.dtype or v.dtype != p.dtype:
        raise TypeError(f"tensor #{i}: exp_avg/exp_avg_sq must have param's dtype {p.dtype}, "
                        f"got {m.dtype=}, {v.dtype=}")
    if out is not None and out.dtype not in _LOWP_DTYPES:
        raise TypeError(f"tensor #{i}: out_lowp must be bfloat16 or float16, got {out.dtype=}")


def _surely_kernel_ready(p: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None) -> bool:
    """The common case, checked with as few attribute reads as possible: a valid tensor set the
    kernel takes as is. False means "look closer" (maybe the reference path, maybe an error).
    Per-tensor Python checks are the whole overhead of a many-tensor step, so this matters."""
    try:
        n = p.numel()
        dev = p.device
        if (p.dtype is not _F32 or m.dtype is not _F32 or v.dtype is not _F32 or g.dtype not in _GRAD_DTYPES
                or m.numel() != n or v.numel() != n or g.numel() != n
                or m.device != dev or v.device != dev or g.device != dev
                or not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous())):
            return False
        if out is not None and (out.dtype not in _LOWP_DTYPES or out.numel() != n or out.device != dev
                                or not out.is_contiguous()):
            return False
        return dev.type in ("cpu", "cuda")
    except AttributeError:  # not a tensor: the full check names the culprit
        return False


def _kernel_ok(p: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None) -> bool:
    if p.dtype != torch.float32 or g.dtype not in _GRAD_DTYPES or p.device.type not in ("cpu", "cuda"):
        return False
    tensors = (p, g, m, v) if out is None else (p, g, m, v, out)
    return all(t.is_contiguous() for t in tensors)


def adam_step_multi_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                     exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                     grad_scale: float = 1.0,
                     out_lowps: Sequence[Tensor | None] | None = None) -> None:
    """``adam_step_`` over lists that share hyperparameters and step: one kernel launch (and
    one OpenMP fork/join on CPU) per device and copy-out kind instead of one per tensor."""
    step = _check_hyper(step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    n = len(params)
    outs: list[Tensor | None] = [None] * n if out_lowps is None else list(out_lowps)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(outs) == n):
        raise ValueError(f"list lengths differ: {n} params, {len(grads)} grads, {len(exp_avgs)} "
                         f"exp_avgs, {len(exp_avg_sqs)} exp_avg_sqs, {len(outs)} out_lowps")

    def reference(i: int) -> None:
        reference_adam_step_(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], step=step, lr=lr,
                             beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                             adamw_mode=adamw_mode, grad_scale=grad_scale, out_lowp=outs[i])

    batches: dict[tuple[torch.device, bool], list[int]] = {}
    for i, (p, g, m, v, out) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, outs)):
        if not _surely_kernel_ready(p, g, m, v, out):
            _check_tensors(i, p, g, m, v, out)
            if not _kernel_ok(p, g, m, v, out):
                reference(i)
                continue
        batches.setdefault((p.device, out is not None), []).append(i)
    for (device, has_out), idx in batches.items():
        state = REGISTRY.cpu() if device.type == "cpu" else REGISTRY.cuda()
        if state.module is None:
            REGISTRY.warn_fallback(state)
            for i in idx:
                reference(i)
            continue
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            state.module.adam_step(
                [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx], [outs[i] for i in idx] if has_out else [],
                step, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                bool(adamw_mode), float(grad_scale))


def adam_step_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               adamw_mode: bool, grad_scale: float = 1.0, out_lowp: Tensor | None = None) -> None:
    """One Adam (``adamw_mode=False``, L2 decay) or AdamW step, in place.

    ``grad`` is multiplied by ``grad_scale`` (loss-scale unscale x clip coefficient) before
    use and is not modified. When ``out_lowp`` is given, the updated parameter is also
    written there (bf16/fp16) in the same pass. ``step`` counts steps including this one.
    """
    adam_step_multi_([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                     grad_scale=grad_scale, out_lowps=[out_lowp])

