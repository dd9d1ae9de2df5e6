"""torch's current names for the two tensor collectives, with the old ones on older torch.

torch 2.13 renamed ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` to
``reduce_scatter_single`` and ``all_gather_single``; the old names print a FutureWarning on
every call, into the logs of every training run. The new names are used where torch has
them (same arguments: output first, then input).
"""
from __future__ import annotations

from typing import Callable, Optional, cast

import torch
import torch.distributed as dist


def _pick(new: str, old: str) -> Callable[..., Optional[dist.Work]]:
    return getattr(dist, new, None) or getattr(dist, old)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor,  # noqa: A002 (torch's name)
                          **kwargs: object) -> dist.Work:
    """``dist.reduce_scatter_single`` (torch >= 2.13) or ``dist.reduce_scatter_tensor``; pass
    ``async_op=True`` for the Work handle."""
    return cast(dist.Work, _pick("reduce_scatter_single", "reduce_scatter_tensor")(output, input, **kwargs))


def all_gather_single(output: torch.Tensor, input: torch.Tensor,  # noqa: A002 (torch's name)
                      **kwargs: object) -> dist.Work:
    """``dist.all_gather_single`` (torch >= 2.13) or ``dist.all_gather_into_tensor``; pass
    ``async_op=True`` for the Work handle."""
    return cast(dist.Work, _pick("all_gather_single", "all_gather_into_tensor")(output, input, **kwargs))


__all__ = ["reduce_scatter_single", "all_gather_single"]
