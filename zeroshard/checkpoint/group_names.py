"""A checkpoint's param groups matched to the optimizer's by the parameters they hold.

Note [param groups by name]: a checkpoint's param groups each list the checkpoint names of
the parameters they train (Note [pipeline checkpoints]: under pipeline parallelism, every
stage's groups in stage order). An optimizer's group takes the hyperparameters of the saved
group(s) holding its parameters, whatever their index: a group split over pipeline stages, or
stages joined into one process, finds its own. A group whose parameters were saved in groups
with different hyperparameters cannot take both: it is refused, naming the parameters, the
options that differ and the grouping to build. A group none of whose parameters were saved in
a group (one of frozen parameters only) keeps the saved group of its index when that one
holds none either, as before groups were matched by name.
"""
from __future__ import annotations

import json
from typing import Optional

from zeroshard.checkpoint import jsontree
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _key(group: dict) -> str:
    return json.dumps(jsontree.encode(_options(group), "param_groups"), sort_keys=True, default=repr)


def resolve(saved_groups: list[object], mine: list[list[str]], where: str) -> list[Optional[dict]]:
    """For each of the optimizer's groups (its parameters' checkpoint names), the saved options
    it takes (None: none saved for it); CheckpointMismatchError where its parameters were saved
    with different options (Note [param groups by name])."""
    saved: list[dict] = [g if isinstance(g, dict) and isinstance(g.get("params"), list) else {"params": []}
                         for g in saved_groups]
    owner = {n: i for i, g in enumerate(saved) for n in g["params"]}
    out: list[Optional[dict]] = []
    taken: dict[int, int] = {}  # saved group -> the first of this optimizer's groups holding its parameters
    for gi, names in enumerate(mine):
        sources = sorted({owner[n] for n in names if n in owner})
        if not sources:
            empty = gi < len(saved) and not saved[gi]["params"] and not names
            out.append(_options(saved[gi]) if empty else None)
            continue
        if len({_key(saved[i]) for i in sources}) > 1:
            a, b = sources[0], next(i for i in sources if _key(saved[i]) != _key(saved[sources[0]]))
            differ = sorted(k for k in set(_options(saved[a])) | set(_options(saved[b]))
                            if _key({k: saved[a].get(k)}) != _key({k: saved[b].get(k)}))
            held = {i: [n for n in names if owner.get(n) == i] for i in (a, b)}
            raise CheckpointMismatchError(
                f"{where}: this optimizer's param group {gi} holds {held[a][:3]} and {held[b][:3]}, which were "
                f"saved in groups with different {differ} ({', '.join(f'{k}={saved[a].get(k)!r} vs {saved[b].get(k)!r}' for k in differ[:3])}); "
                f"build the optimizer with param groups that keep them apart, as saved: {_listing(saved)}")
        for i in sources:
            if taken.setdefault(i, gi) != gi:
                raise CheckpointMismatchError(
                    f"{where}: this optimizer's param groups {taken[i]} and {gi} both hold parameters saved in one "
                    f"group ({saved[i]['params'][:3]}...), whose options would replace both groups' own; build the "
                    f"optimizer with param groups as saved: {_listing(saved)}")
        out.append(_options(saved[sources[0]]))
    return out


def _listing(saved: list[dict]) -> str:
    return "[" + ", ".join(f"{g['params'][:3]}{'...' if len(g['params']) > 3 else ''} ({len(g['params'])} "
                           f"parameters)" for g in saved) + "]"
