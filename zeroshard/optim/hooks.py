"""torch.optim's state-dict hooks around ZeroOptimizer's own state_dict / load_state_dict.

torch runs ``register_state_dict_pre/post_hook`` and ``register_load_state_dict_pre/post_hook``
inside ``Optimizer.state_dict`` / ``load_state_dict``; ZeroOptimizer replaces both methods
(its state is sharded), so it runs the hooks itself, with torch's contract: a state-dict
post-hook or a load pre-hook may return a replacement dict, the load works on a shallow
copy of what it was given.
"""
from __future__ import annotations

from typing import Any, Callable


def with_state_dict_hooks(opt: Any, produce: Callable[[], dict]) -> dict:
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = produce()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def with_load_state_dict_hooks(opt: Any, state_dict: dict, apply: Callable[[dict], None]) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict takes a dict (optimizer.state_dict()), got {type(state_dict).__name__}")
    state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    apply(state_dict)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
