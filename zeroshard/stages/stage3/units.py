"""Choosing stage-3 units: which modules' parameters are gathered and released together.

Default: every repeated block, i.e. each child of a ``ModuleList``/``Sequential`` whose
children with parameters all share one class (transformer layers), plus one *root* unit for
everything else (embeddings, final norm, head). ``unit_classes`` picks modules by class name
instead, and ``unit_numel`` takes the largest subtrees of at most that many parameters
(the size-based wrap policy of FSDP). A parameter reachable from two units, or from a unit
and the root (tied embeddings: GPT-2's ``lm_head`` shares the token embedding), goes to the
root unit, which stays gathered through forward and backward, so tied and shared weights are
always present where they are used.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from zeroshard.layout import NamedParam


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    taken: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or id(module) in taken:
            continue
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            found.extend(children)
            for c in children:
                taken.update(id(m) for m in c.modules())
    return found


def _by_class(model: nn.Module, class_names: Sequence[str]) -> list[nn.Module]:
    wanted = set(class_names)
    found: list[nn.Module] = []
    taken: set[int] = set()
    for module in model.modules():
        if module is not model and type(module).__name__ in wanted and id(module) not in taken:
            found.append(module)
            taken.update(id(m) for m in module.modules())
    if not found:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"stage3_unit_classes={list(class_names)} matches no module of "
                         f"{type(model).__name__}; its module classes are {names}")
    return found


def _by_size(model: nn.Module, numel: int, sizes: dict[int, int]) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            n = sum(sizes.get(id(p), p.numel()) for p in child.parameters())
            if n == 0:
                continue
            if n <= numel:
                found.append(child)
            else:
                visit(child)
    visit(model)
    return found


def plan_units(model: nn.Module, trainable: Sequence[NamedParam],
               unit_classes: Optional[Sequence[str]] = None,
               unit_numel: Optional[int] = None) -> tuple[list[list[NamedParam]], list[Optional[nn.Module]]]:
    """Groups trainable parameters into stage-3 units, in *backward* order: the last block
    first, the root unit last (its embedding gradients are the last to complete).

    Returns the groups and, per group, the module whose forward gathers it (None = root).
    """
    if unit_classes:
        modules = _by_class(model, unit_classes)
    elif unit_numel:
        modules = _by_size(model, unit_numel, {id(m.param): m.true_shape.numel() for m in trainable})
    else:
        modules = _repeated_blocks(model)
    by_id = {id(m.param): m for m in trainable}
    owners: dict[int, set] = {pid: set() for pid in by_id}
    for ui, module in enumerate(modules):
        for p in module.parameters():
            if id(p) in owners:
                owners[id(p)].add(ui)
    inside = {id(m) for module in modules for m in module.modules()}
    for module in model.modules():
        if id(module) not in inside:
            for p in module.parameters(recurse=False):
                if id(p) in owners:
                    owners[id(p)].add("root")
    groups: list[list[NamedParam]] = [[] for _ in modules]
    root: list[NamedParam] = []
    for m in trainable:
        where = owners[id(m.param)]
        if len(where) == 1 and "root" not in where:
            groups[next(iter(where))].append(m)
        else:
            root.append(m)
    pairs = [(g, mod) for g, mod in zip(groups, modules) if g]
    pairs.reverse()
    out_groups = [g for g, _ in pairs]
    out_modules: list[Optional[nn.Module]] = [mod for _, mod in pairs]
    if root:
        out_groups.append(root)
        out_modules.append(None)
    return out_groups, out_modules

