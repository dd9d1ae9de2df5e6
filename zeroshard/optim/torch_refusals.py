"""torch.optim's own refusals, with torch's error types and messages: code and test suites
written against torch.optim catch ``ValueError`` for a multi-element tensor ``lr`` and match
``Invalid beta parameter at index 0`` (torch's ``test_errors``), so where torch refuses an
argument a ZeroOptimizer over a torch class refuses it the same way, with zeroshard's
explanation added when its own checks name the argument more precisely.

Only torch's own elementwise classes are asked: their constructors check arguments and
allocate nothing, so building one over the user's parameters is a pure check. A user's class
may do anything in its constructor, and whole-tensor classes (Muon) refuse shapes the
whole-tensor layout handles (Note [whole-tensor units] in zeroshard/layout/bucketing.py).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Optional

import torch
from torch import nn

from zeroshard.units.elementwise import update_kind


def torch_refusal(optimizer_class: type, params: object, kwargs: dict) -> Optional[Exception]:
    """What ``optimizer_class(params, **kwargs)`` raises (None: it builds, or the class is not
    one of torch's elementwise optimizers). ``params`` None checks the keyword arguments alone;
    a module gives its parameters; an iterator is never read (the caller reads it once)."""
    if not (isinstance(optimizer_class, type) and optimizer_class.__module__.startswith("torch.optim")):
        return None
    try:
        if update_kind(optimizer_class) != "elementwise":
            return None
    except (TypeError, ValueError):
        return None
    if params is None or isinstance(params, Iterator):
        params = [nn.Parameter(torch.zeros(1))]
    elif isinstance(params, nn.Module):
        params = list(params.parameters())
    elif isinstance(params, (list, tuple)):
        # (copies: torch's constructor fills its defaults into each group dict in place, which
        # would give a group on another class, e.g. Muon's, this class's weight_decay)
        params = [dict(g) if isinstance(g, dict) else g for g in params]
    try:
        with warnings.catch_warnings():  # (torch warns of duplicates in a group; the real build warns once)
            warnings.simplefilter("ignore")
            optimizer_class(params, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        return exc
    except Exception:  # (an accident of torch's code, e.g. IndexError for betas=(0.9,): zeroshard's message)
        return None
    return None


def as_torch_refusal(theirs: Exception, ours: Optional[Exception] = None) -> Exception:
    """torch's error type and message, then zeroshard's (which names the argument and the fix)."""
    text = str(theirs) if ours is None or str(ours) == str(theirs) else f"{theirs} ({ours})"
    return type(theirs)(text)
