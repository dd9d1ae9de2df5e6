"""``BlockCheckpointing``: the offloader runs the blocks a mixed plan picks under
``torch.utils.checkpoint`` (Note [checkpointing chosen blocks]).

Note [checkpointing chosen blocks]: with ``PlannedActivations(checkpointed=False)`` the model does
not checkpoint its blocks, and the plan may (Note [mixed activation plans] in
zeroshard/planner/activation_mix.py). Each repeated block's ``forward`` is wrapped once, at
construction (an instance attribute, removed with the offloader); the offloader's pre-hook of a
block call in the model's forward arms the wrapper when the plan in force checkpoints that block,
and the armed wrapper runs the block's own forward under ``checkpoint(use_reentrant=False,
preserve_rng_state=True)``: inside, the block's saved tensors go to the checkpoint's hooks, and its
input is saved through the hooks active at the call, the offloader's, after the block's pre-hook,
so it lands in the block's record when the plan moves it. The recompute in backward (outside the
model's forward) calls the module itself, so its hooks run as for a checkpoint in the model's code
(stage 3 gathers its parameters) and the wrapper, not armed, runs the plain forward. The RNG state
is stashed at the call and restored for the recompute, so dropout draws the same bits; the
recompute runs the same operations on the same bytes, so gradients are the same bits as without it.
A block whose ``checkpoint_parts()`` names parts (TinyGPT's attention and MLP halves: Note
[checkpoints finer than a block] in zeroshard/testing/toy.py) runs one checkpoint per part, each
on the previous part's output: every part's input is saved through the offloader's hooks inside
the block call, so all of them land in the block's record and move together. A part's recompute
calls the part itself: backward reaches it inside the block's backward, after stage 3's hook on the
block's output has gathered the block's parameters.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class BlockCheckpointing:
    def __init__(self, blocks: list[nn.Module], in_forward: Callable[[], bool]) -> None:
        self.chosen: frozenset[int] = frozenset()
        """id() of the blocks the plan in force checkpoints."""
        self._in_forward = in_forward
        self._armed: Optional[nn.Module] = None
        self._wrapped: list[tuple[nn.Module, Optional[Callable]]] = []
        for m in blocks:
            own = m.__dict__.get("forward")  # (a forward already set on the instance: restored by remove())
            self._wrapped.append((m, own))
            m.forward = self._wrap(m, m.forward)  # type: ignore[method-assign]

    def arm(self, module: nn.Module) -> None:
        """A block call of the model's forward starts (its pre-hooks ran): checkpoint it if chosen."""
        self._armed = module if id(module) in self.chosen else None

    def _wrap(self, module: nn.Module, inner: Callable) -> Callable:
        def forward(*args: object, **kwargs: object) -> object:
            if self._armed is not module or not self._in_forward():
                return inner(*args, **kwargs)
            self._armed = None

            def run(*a: object) -> object:  # (in backward's recompute: through the module, hooks and all)
                return inner(*a, **kwargs) if self._in_forward() else module(*a, **kwargs)
            named = getattr(module, "checkpoint_parts", None)
            parts = named() if callable(named) else ()
            if parts:
                return _in_parts(module, parts, args, kwargs)
            # (keyword arguments stay in the closure: the positional ones, the block's input, are what is saved)
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
        return forward

    def remove(self) -> None:
        for m, own in self._wrapped:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own  # type: ignore[method-assign]
        self._wrapped = []


def _in_parts(module: nn.Module, parts: Sequence[Callable[[Tensor], Tensor]], args: tuple, kwargs: dict) -> Tensor:
    """One checkpoint per part, each on the previous part's output (Note [checkpointing chosen blocks])."""
    if len(args) != 1 or not isinstance(args[0], Tensor) or kwargs:
        raise ValueError(
            f"activation offload: {type(module).__name__}.checkpoint_parts() names {len(parts)} parts, which take one "
            f"tensor each, but the block was called with {len(args)} positional arguments "
            f"({[type(a).__name__ for a in args]}) and keywords {sorted(kwargs)}; return () from checkpoint_parts() "
            "to checkpoint the block whole")
    x = args[0]
    for part in parts:
        x = checkpoint(part, x, use_reentrant=False, preserve_rng_state=True)
    return x
