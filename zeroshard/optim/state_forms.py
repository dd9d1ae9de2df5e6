"""Other forms of a ZeroOptimizer's state dict than its own sharded one, registered by the code
that defines them (``checkpoint/torch_state_dict.py``: torch's state-dict API's form), so that
the optimizer hands them out without importing checkpoint code, which builds on it."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner


@dataclass(frozen=True)
class StateForm:
    name: str
    asked: Callable[[FrameType], bool]
    """Whether ``state_dict()``'s caller (its frame) wants this form."""
    produce: Callable[["EngineOwner"], dict]
    accepts: Callable[[dict], bool]
    """Whether a dict given to ``load_state_dict`` is in this form."""
    load: Callable[["EngineOwner", dict], None]


_FORMS: dict[str, StateForm] = {}


def register(form: StateForm) -> None:
    _FORMS[form.name] = form


def produce(opt: "EngineOwner") -> Optional[dict]:
    """The state dict in the form ``state_dict()``'s caller asks for, or None: the optimizer's
    own. Called by ``state_dict()`` itself: frame 1 is it, frame 2 its caller."""
    caller = sys._getframe(2)
    form = next((f for f in _FORMS.values() if f.asked(caller)), None)
    return form.produce(opt) if form is not None else None


def loader(state_dict: dict) -> Optional[Callable[["EngineOwner", dict], None]]:
    return next((f.load for f in _FORMS.values() if f.accepts(state_dict)), None)
