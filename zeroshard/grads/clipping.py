"""``ZeroOptimizer.clip_grad_norm_``: the true global norm of gradients sharded across ranks.

With Adam/AdamW on the fused kernel the coefficient is applied inside the optimizer pass
rather than by rewriting the gradients (one sweep less); a second call before ``step``
therefore sees the unclipped gradients again and sets the same coefficient.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch



def check_clip_arguments(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """(max_norm, norm_type) as numbers, as ``torch.nn.utils.clip_grad_norm_`` reads them
    (``float(norm_type)``: "inf" and "2" are accepted there too), or an error naming the
    argument. A negative bound would flip every gradient's sign; torch does not check it."""
    try:
        bound = float(max_norm)
    except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of more than one element)
        raise TypeError(f"max_norm={max_norm!r} must be a number >= 0 (the largest gradient norm kept), "
                        f"not a {type(max_norm).__name__}") from None
    if math.isnan(bound) or bound < 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (the largest gradient norm kept); "
                         "a negative bound would reverse the gradients")
    try:
        order = float(norm_type)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"norm_type={norm_type!r} must be a number (the order p of the p-norm, e.g. 2.0, "
                         "or float('inf') for the largest magnitude)") from None
    if math.isnan(order):
        raise ValueError(f"norm_type={norm_type!r} must be a number, e.g. 2.0 or float('inf')")
    return bound, order


def clip_coefficient(total: torch.Tensor, max_norm: float, norm_type: float,
                     error_if_nonfinite: bool) -> Optional[torch.Tensor]:
    """The factor gradients are multiplied by (at most 1), or None when the norm ``total`` is
    not finite (nothing is clipped then, as torch leaves them; an error if asked for)."""
    if not torch.isfinite(total):
        if error_if_nonfinite:
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}")
        return None
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
