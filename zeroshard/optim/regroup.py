"""A consolidated optimizer state dict (torch.optim format) in another grouping of the same
parameters, matched by name.

Note [regrouped state]: a Trainer checkpoint written through ``ZeroCallback`` holds the
ZeroOptimizer's consolidated state; a plain ``Trainer`` resuming it builds its own AdamW with
two groups (decay / no decay) and torch's ``load_state_dict`` refuses a state of one group
("different number of parameter groups"). So the callback writes the state in the Trainer's
grouping (``to_grouping``), each group carrying its parameters' names (``param_names``, which
torch keeps) and the options of the ZeroOptimizer group its parameters trained in; a
ZeroOptimizer loading a state whose groups name their parameters takes it back into its own
grouping by name (``to_own_grouping``), whatever grouping wrote it. A grouping that would put
parameters trained with different options in one group is not written (the state keeps the
optimizer's own grouping).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner

_NOT_OPTIONS = ("params", "param_names", "optimizer_class")


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _NOT_OPTIONS}


def _own(opt: "EngineOwner") -> list[list[tuple[str, bool]]]:
    """Per own group: (name, trained) of each parameter, in state-dict index order."""
    return [[(opt.engine.param_names[id(p)], p.requires_grad) for p in g["params"]] for g in opt.param_groups]


def to_grouping(opt: "EngineOwner", sd: dict, groups: Sequence[Sequence[str]]) -> Optional[dict]:
    """``sd`` (``opt``'s consolidated state) with the trained parameters grouped as ``groups``
    (names); None when the names are not ``opt``'s trained parameters or a group would mix
    options (Note [regrouped state])."""
    where: dict[str, tuple[int, int]] = {}
    i = 0
    for gi, members in enumerate(_own(opt)):
        for name, trained in members:
            if trained:
                where[name] = (gi, i)
            i += 1
    if sorted(where) != sorted(n for g in groups for n in g):
        return None
    out_groups, state, j = [], {}, 0
    for names in groups:
        options = [_options(sd["param_groups"][where[n][0]]) for n in names] or [_options(sd["param_groups"][0])]
        if any(o != options[0] for o in options):
            return None
        out_groups.append({**options[0], "params": list(range(j, j + len(names))), "param_names": list(names)})
        for n in names:
            if where[n][1] in sd["state"]:
                state[j] = sd["state"][where[n][1]]
            j += 1
    return {**sd, "state": state, "param_groups": out_groups}


def to_own_grouping(opt: "EngineOwner", sd: dict) -> dict:
    """``sd`` in ``opt``'s own grouping when its groups name their parameters and group them
    otherwise; as it is in every other case (the usual checks judge it)."""
    groups = sd.get("param_groups")
    if not groups or not all(isinstance(g, dict) and isinstance(g.get("param_names"), list) for g in groups):
        return sd
    own = _own(opt)
    saved = [list(g["param_names"]) for g in groups]
    if saved == [[n for n, _ in members] for members in own]:
        return sd
    at: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for name, index in zip(g["param_names"], g["params"]):
            at[name] = (gi, index)
    if sorted(at) != sorted(n for members in own for n, trained in members if trained):
        return sd
    out_groups, state, j = [], {}, 0
    for g, members in zip(opt.param_groups, own):
        options = [_options(groups[at[n][0]]) for n, trained in members if trained]
        same = bool(options) and all(o == options[0] for o in options)
        regrouped: dict[str, object] = {**(options[0] if same else _options(g)), "params": list(range(j, j + len(members)))}
        if "param_names" in g:
            regrouped["param_names"] = [n for n, _ in members]
        out_groups.append(regrouped)
        for name, trained in members:
            if trained and at[name][1] in sd.get("state", {}):
                state[j] = sd["state"][at[name][1]]
            j += 1
    return {**sd, "state": state, "param_groups": out_groups}


SCHEDULER_KEY = "zeroshard_param_groups"
"""Set in a scheduler state regrouped by ``scheduler_to_grouping``: the names of its groups
(a plain scheduler loading it keeps the key as an unused attribute)."""


def _first_group(opt: "EngineOwner") -> dict[str, int]:
    return {opt.engine.param_names[id(p)]: gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}


def scheduler_to_grouping(opt: "EngineOwner", state: dict, groups: Sequence[Sequence[str]]) -> dict:
    """A scheduler's state (per-group lists: ``base_lrs``, ``_last_lr``, ...) for ``groups``:
    each group takes the value of its parameters' group in ``opt`` (Note [regrouped state])."""
    own = _first_group(opt)
    index = [own[names[0]] if names else 0 for names in groups]
    n = len(opt.param_groups)
    out = {k: [v[i] for i in index] if isinstance(v, list) and len(v) == n else v for k, v in state.items()}
    out[SCHEDULER_KEY] = [list(g) for g in groups]
    return out


def scheduler_to_own_grouping(opt: "EngineOwner", state: dict) -> dict:
    """The inverse of ``scheduler_to_grouping`` (as it is when it was not regrouped)."""
    groups = state.get(SCHEDULER_KEY)
    if not isinstance(groups, list):
        return state
    at = {name: k for k, names in enumerate(groups) for name in names}
    index = []
    for g in opt.param_groups:
        names = [opt.engine.param_names[id(p)] for p in g["params"] if opt.engine.param_names[id(p)] in at]
        index.append(at[names[0]] if names else 0)
    out = {k: [v[i] for i in index] if isinstance(v, list) and len(v) == len(groups) else v
           for k, v in state.items() if k != SCHEDULER_KEY}
    return out
