"""torch's current names for the two tensor collectives, with the old ones on older torch.

torch 2.13 renamed ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` to
``reduce_scatter_single`` and ``all_gather_single``; the old names print a FutureWarning on
every call, into the logs of every training run. The new names are used where torch has
them (same arguments: output first, then input).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist


def _pick(new: str, old: str) -> Callable[..., Any]:
    return getattr(dist, new, None) or getattr(dist, old)


def reduce_scatter_single(output: Any, input: Any, **kwargs: Any) -> Any:  # noqa: A002 (torch's name)
    """``dist.reduce_scatter_single`` (torch >= 2.13) or ``dist.reduce_scatter_tensor``."""
    return _pick("reduce_scatter_single", "reduce_scatter_tensor")(output, input, **kwargs)


def all_gather_single(output: Any, input: Any, **kwargs: Any) -> Any:  # noqa: A002 (torch's name)
    """``dist.all_gather_single`` (torch >= 2.13) or ``dist.all_gather_into_tensor``."""
    return _pick("all_gather_single", "all_gather_into_tensor")(output, input, **kwargs)


__all__ = ["reduce_scatter_single", "all_gather_single"]
