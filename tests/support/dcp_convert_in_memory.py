"""The in-memory ``convert-dcp`` zeroshard had before it streamed: the oracle a streamed
conversion is compared with, tensor by tensor (tests/checkpoint/test_dcp_convert_streaming.py).

Both directions go through the loaders and savers the training path uses, at world size 1: a
model holding the checkpoint's names and shapes is built from its table of contents (the
manifest, or the DCP metadata), a ZeroOptimizer of the optimizer class the saved param groups
name is put over it, ``load_checkpoint`` reads SRC into them (every check of a resume) and
``save_checkpoint`` writes DST. This holds the whole state in memory once (weights, master and
moments of every parameter), unlike ``export_hf``, which streams a shard at a time.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from zeroshard.checkpoint import dcp_metadata, jsontree, locate
from zeroshard.checkpoint.dcp_read import DcpSource
from zeroshard.checkpoint.formats import load_checkpoint, save_checkpoint
from zeroshard.checkpoint.shard_file import DTYPES
from zeroshard.checkpoint.dcp_convert import optimizer_class
from zeroshard.optim.zero_optimizer import ZeroOptimizer

class _Model(nn.Module):
    """Parameters and buffers under the checkpoint's dotted names."""

    def put(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, trainable: bool) -> None:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        value = torch.zeros(shape, dtype=dtype)
        if trainable:
            module.register_parameter(leaf, nn.Parameter(value))
        else:
            module.register_buffer(leaf, value)


class _Kept:
    """Stands in for the scheduler (or data loader): keeps the state it is given, hands it on."""

    def __init__(self) -> None:
        self.state: Optional[dict] = None

    def state_dict(self) -> dict:
        return self.state if self.state is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        self.state = state_dict


def _groups(model: _Model, per_param: dict[str, dict]) -> list[dict]:
    """Param groups: parameters with the same saved options together, in model order."""
    groups: list[dict] = []
    for name, p in model.named_parameters():
        options = {k: v for k, v in per_param[name].items() if k != "initial_lr"}
        for g in groups:
            if g["options"] == options:
                g["params"].append(p)
                break
        else:
            groups.append({"options": options, "params": [p]})
    return groups


def _optimizer(model: _Model, per_param: dict[str, dict]) -> ZeroOptimizer:
    groups = _groups(model, per_param)
    cls = optimizer_class(groups[0]["options"])
    known = set(cls([torch.zeros(1, requires_grad=True)]).defaults) - {"foreach", "fused", "capturable",
                                                                           "differentiable"}
    return ZeroOptimizer([{"params": g["params"], **{k: v for k, v in g["options"].items() if k in known}}
                          for g in groups], cls, stage=1, module=model)


def _from_dcp(src: str) -> tuple[_Model, ZeroOptimizer]:
    source = DcpSource(src)
    model = _Model()
    saved = source.model_names()
    per_param: dict[str, dict] = {}
    for key in source.entries:
        if key.startswith("optimizer.param_groups."):
            fqn, option = key[len("optimizer.param_groups."):].rsplit(".", 1)
            per_param.setdefault(fqn, {})[option] = source.value(key)
    for name, entry in saved.items():
        model.put(name, tuple(entry.size), entry.properties.dtype, name in per_param)
    if not per_param:
        raise ValueError(f"{src} holds no optimizer param groups (optimizer.param_groups.*): only a model; "
                         "nothing to resume from")
    return model, _optimizer(model, per_param)


def _from_native(step_dir: str) -> tuple[_Model, ZeroOptimizer]:
    body = locate.check_step(step_dir)
    groups = jsontree.decode(body.get("param_groups", []), f"{step_dir}: param_groups")
    per_param = {n: {k: v for k, v in g.items() if k != "params"} for g in groups for n in g["params"]}
    model = _Model()
    for name, meta in body["tensors"].items():
        model.put(name, tuple(meta["shape"]), DTYPES[meta["dtype"]], name in per_param)
    return model, _optimizer(model, per_param)


def convert_dcp(src: str, dst: str) -> str:
    """Converts ``src`` (a DCP directory, or a native root or step directory) into the other
    format under the root ``dst``; returns the step directory written."""
    src = os.fspath(src)
    to_native = dcp_metadata.is_dcp_dir(src)
    if not to_native:
        found = src if locate.is_step_dir(src) else locate.latest_checkpoint(src)
        if found is None:
            raise ValueError(f"{src!r} is neither a DCP directory (.metadata) nor a zeroshard checkpoint")
        src = found
    model, opt = _from_dcp(src) if to_native else _from_native(src)
    sched, data = _Kept(), _Kept()
    if to_native:
        info = load_checkpoint(src, model=model, optimizer=opt, scheduler=sched, dataloader=data)
    else:  # (the native loader refuses to hand a scheduler state or data position it does not hold)
        trainer = locate.check_step(src).get("trainer") or {}
        info = load_checkpoint(src, model=model, optimizer=opt,
                               scheduler=sched if trainer.get("scheduler") is not None else None,
                               dataloader=data if any(s is not None for s in trainer.get("dataloader") or []) else None)
    path = save_checkpoint(os.fspath(dst), int(info["step"]), model=model, optimizer=opt,
                           scheduler=sched if sched.state is not None else None,
                           dataloader=data if data.state is not None else None,
                           extra=info.get("extra"), format="native" if to_native else "dcp").wait()
    opt.close()
    return path
