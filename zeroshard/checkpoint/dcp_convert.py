"""``zeroshard convert-dcp SRC DST``: a native checkpoint to a torch Distributed Checkpoint, or
back, offline in one process.

Streamed (Note [streaming DCP conversion]): the writer of DST asks for one tensor at a time
and it is read then from the chunks or pieces of SRC that hold it, so memory holds about one
tensor, not the state. What is written is what loading SRC into a world-1, stage-1
ZeroOptimizer of the saved optimizer class and saving it in the other format writes; the
small state (param groups as that optimizer holds them) comes from such an optimizer built
over one-element stand-ins.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
from torch import nn

from zeroshard.checkpoint import dcp_metadata, jsontree, locate
from zeroshard.checkpoint.dcp_read import DcpSource
from zeroshard.checkpoint.dcp_to_native import to_native
from zeroshard.checkpoint.native_to_dcp import to_dcp
from zeroshard.optim.zero_optimizer import ZeroOptimizer

CLASSES = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop)
"""The optimizer classes a converted checkpoint may name (by the options its groups keep)."""


def optimizer_class(options: dict) -> type:
    """The class whose options a saved param group holds (Adam and AdamW told apart by
    ``decoupled_weight_decay``)."""
    fits = []
    for cls in CLASSES:
        defaults = set(cls([torch.zeros(1, requires_grad=True)]).defaults)
        if defaults <= set(options):
            fits.append((len(defaults), cls))
    if not fits:
        raise ValueError(f"the saved param group's options {sorted(options)} are not those of any of "
                         f"{[c.__name__ for c in CLASSES]}; such a checkpoint does not convert")
    best = max(n for n, _ in fits)
    found = [c for n, c in fits if n == best]
    if torch.optim.AdamW in found and torch.optim.Adam in found:
        return torch.optim.AdamW if options.get("decoupled_weight_decay") else torch.optim.Adam
    return found[0]


def _option_groups(names: list[str], per_param: dict[str, dict]) -> list[tuple[dict, list[str]]]:
    """Param groups: parameters with the same saved options together, in the order given."""
    groups: list[tuple[dict, list[str]]] = []
    for name in names:
        options = {k: v for k, v in per_param[name].items() if k != "initial_lr"}
        for held, members in groups:
            if held == options:
                members.append(name)
                break
        else:
            groups.append((options, [name]))
    return groups


def _live_groups(groups: list[tuple[dict, list[str]]]) -> tuple[list[dict], str, Optional[str]]:
    """Each group's options as a ZeroOptimizer of the saved class (world 1, stage 1) holds them
    once built with the saved options, its inner optimizer's class name and its mixed
    precision: what a load into it and a save would write. Built over one-element stand-ins,
    so it costs nothing of the model's size."""
    cls = optimizer_class(groups[0][0])
    known = set(cls([torch.zeros(1, requires_grad=True)]).defaults) - {"foreach", "fused", "capturable",
                                                                           "differentiable"}
    stand_ins = [nn.Parameter(torch.zeros(1)) for _ in groups]
    opt = ZeroOptimizer([{"params": [p], **{k: v for k, v in options.items() if k in known}}
                         for p, (options, _) in zip(stand_ins, groups)], cls, stage=1)
    try:
        live = [{k: v for k, v in g.items() if k not in ("params", "param_names", "optimizer_class")}
                for g in opt.param_groups]
        return live, type(opt.engine.joined().inner).__name__, opt.engine.config.mixed_precision
    finally:
        opt.close()


def module_order(names: list[str]) -> list[str]:
    """``names`` in the order ``named_parameters`` of a module built by registering them in
    this order would list them: a module's own tensors, then its submodules' in turn."""
    root: tuple[list[str], dict] = ([], {})
    for name in names:
        node = root
        for part in name.split(".")[:-1]:
            node = node[1].setdefault(part, ([], {}))
        node[0].append(name)
    out: list[str] = []

    def walk(node: tuple[list[str], dict]) -> None:
        out.extend(node[0])
        for child in node[1].values():
            walk(child)
    walk(root)
    return out


def _from_dcp(src: str, dst: str) -> str:
    source = DcpSource(src)
    per_param: dict[str, dict] = {}
    for key in source.entries:
        if key.startswith("optimizer.param_groups."):
            fqn, option = key[len("optimizer.param_groups."):].rsplit(".", 1)
            per_param.setdefault(fqn, {})[option] = source.value(key)
    if not per_param:
        raise ValueError(f"{src} holds no optimizer param groups (optimizer.param_groups.*): only a model; "
                         "nothing to resume from")
    trained = [n for n in module_order(list(source.model_names())) if n in per_param]
    groups = _option_groups(trained, per_param)
    live, inner, precision = _live_groups(groups)
    return to_native(src, dst, per_param, [members for _, members in groups], live, inner, precision)


def _from_native(step_dir: str, dst: str) -> str:
    body = locate.check_step(step_dir)
    saved = jsontree.decode(body.get("param_groups", []), f"{step_dir}: param_groups")
    per_param = {n: {k: v for k, v in g.items() if k != "params"} for g in saved for n in g["params"]}
    trained = [n for n in body["tensors"] if n in per_param]
    if not trained:
        raise ValueError(f"{step_dir} holds no optimizer param groups: nothing to convert")
    groups = _option_groups(trained, per_param)
    live = _live_groups(groups)[0]
    options = {n: {**live[gi], **per_param[n]} for gi, (_, members) in enumerate(groups) for n in members}
    return to_dcp(step_dir, body, dst, options)


def convert_dcp(src: str, dst: str) -> str:
    """Converts ``src`` (a DCP directory, or a native root or step directory) into the other
    format under the root ``dst``, streamed (Note [streaming DCP conversion]); returns the
    step directory written."""
    src = os.fspath(src)
    if dcp_metadata.is_dcp_dir(src):
        return _from_dcp(src, os.fspath(dst))
    found = src if locate.is_step_dir(src) else locate.latest_checkpoint(src)
    if found is None:
        raise ValueError(f"{src!r} is neither a DCP directory (.metadata) nor a zeroshard checkpoint")
    return _from_native(found, os.fspath(dst))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a DCP checkpoint directory (FSDP2, torchtitan), or a zeroshard checkpoint "
                                    "root or step directory")
    parser.add_argument("dst", help="the checkpoint root to write, in the other format")


def run(args: argparse.Namespace) -> int:
    print(f"wrote {convert_dcp(args.src, args.dst)}")
    return 0
