"""Which placement a ZeroOptimizer builds, chosen once from its config: ``AutoPlacement`` under
``offload="auto"``, else ``ExplicitPlacement``; a ``placement_policy`` of the user's over it."""
from __future__ import annotations

import types

from zeroshard.config import ZeroConfig
from zeroshard.offload.placement import StatePlacement
from zeroshard.offload.placement_auto import AutoPlacement
from zeroshard.offload.placement_explicit import ExplicitPlacement


def placement_class(config: ZeroConfig) -> type[StatePlacement]:
    """The placement for ``config``: the built-in one its offload options name, or
    ``config.placement_policy`` (a class in one file, e.g. tests/support/placement_example.py).
    A policy subclassing ``StatePlacement`` itself decides what it overrides and takes the rest
    from the built-in one (``_over``); one subclassing ``ExplicitPlacement`` or ``AutoPlacement``
    is taken as it is, where the options name that one."""
    chosen: type[StatePlacement] = AutoPlacement if config.automatic else ExplicitPlacement
    cls = config.placement_policy
    if cls is None:
        return chosen
    if not issubclass(cls, StatePlacement):
        raise TypeError(f"placement_policy={cls.__name__} must subclass zeroshard.offload.placement.StatePlacement "
                        "(it is built with the same arguments and overrides what it decides, e.g. of_unit)")
    if issubclass(cls, chosen):
        return cls
    other = ExplicitPlacement if chosen is AutoPlacement else AutoPlacement
    if issubclass(cls, other):
        raise TypeError(f"placement_policy={cls.__name__} subclasses {other.__name__}, but offload={config.offload!r} "
                        f"asks for {chosen.__name__}: subclass StatePlacement (built over either), or {chosen.__name__}")
    return _over(cls, chosen)


_MADE: dict[tuple[type, type], type[StatePlacement]] = {}


def _over(policy: type[StatePlacement], chosen: type[StatePlacement]) -> type[StatePlacement]:
    """``policy`` over ``chosen``: the policy's methods first, the built-in placement's for the
    rest (one class per pair, so ``type(placement)`` stays the same across optimizers). It keeps
    the policy's name and module, and ``isinstance(placement, policy)`` holds."""
    made = _MADE.get((policy, chosen))
    if made is None:
        made = types.new_class(policy.__name__, (policy, chosen))
        made.__module__, made.__qualname__, made.__doc__ = policy.__module__, policy.__qualname__, policy.__doc__
        _MADE[(policy, chosen)] = made
    return made
