"""Muon's usual recipe from a config: the hidden 2-D matrices on ``torch.optim.Muon``, the
rest (embeddings, the output head, norms, biases) on AdamW, in one ZeroOptimizer.

Note [Muon from a config]: a DeepSpeed config ``{"type": "Muon", "params": {...}}``, the
fine-tune CLI's ``--optimizer muon`` and ``zeroshard.initialize(..., optimizer=torch.optim.Muon)``
all mean this recipe, as DeepSpeed's own Muon does (it tags hidden 2-D parameters
``use_muon``). Muon's keywords (``lr``, ``momentum``, ``weight_decay``, ``nesterov``,
``ns_steps``, ``ns_coefficients``, ``eps``, ``adjust_lr_fn``) go to the matrices' group; the
AdamW group takes ``adam_lr`` (default: ``lr``), ``adam_betas``, ``adam_eps`` and
``adam_weight_decay`` (default 0). Matrices are chosen by their true shapes (the meta
device's too, before any partitioning), so no matrix silently lands on AdamW; a model with
none is refused rather than trained on AdamW alone.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

ADAM_KEYS = {"adam_lr": "lr", "adam_betas": "betas", "adam_eps": "eps", "adam_weight_decay": "weight_decay"}
"""Keywords of the recipe's AdamW group, by their AdamW names."""


def _not_hidden(model: nn.Module) -> set[int]:
    """Parameters of embeddings and of the output head (Muon is for hidden layers)."""
    out = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        out |= {id(p) for p in head.parameters()}
    return out


def _hidden_matrix(p: torch.Tensor, excluded: set[int]) -> bool:
    return p.ndim == 2 and id(p) not in excluded


def split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """(Muon's keywords, AdamW's) from the recipe's one set."""
    muon = {k: v for k, v in kwargs.items() if k not in ADAM_KEYS}
    adam = {name: kwargs[k] for k, name in ADAM_KEYS.items() if k in kwargs}
    adam.setdefault("lr", muon.get("lr", 1e-3))
    adam.setdefault("weight_decay", 0.0)
    if isinstance(adam.get("betas"), list):
        adam["betas"] = tuple(adam["betas"])
    return muon, adam


def recipe_groups(model: nn.Module, model_parameters: Optional[Iterable[object]], kwargs: dict
                  ) -> tuple[list[dict], type[torch.optim.Optimizer], dict]:
    """(param groups, the class of the rest, its keywords) for ``ZeroOptimizer(groups, cls,
    module=model, **keywords)``: each given group (default: the model's trainable parameters)
    split into its hidden matrices, on Muon, and the rest, keeping the group's own keys."""
    muon_kwargs, adam_kwargs = split_kwargs(kwargs)
    excluded = _not_hidden(model)
    given: list[object] = list(model_parameters) if model_parameters is not None else [
        p for p in model.parameters() if p.requires_grad]
    groups: list[dict] = [g if isinstance(g, dict) else {"params": [g]} for g in given]
    out: list[dict] = []
    for g in groups:
        params = [p[1] if isinstance(p, tuple) else p for p in g["params"]]
        rest_keys = {k: v for k, v in g.items() if k != "params"}
        mats = [p for p in params if _hidden_matrix(p, excluded)]
        others = [p for p in params if not _hidden_matrix(p, excluded)]
        if mats:
            out.append({**muon_kwargs, **rest_keys, "params": mats, "optimizer_class": torch.optim.Muon})
        if others:
            out.append({**rest_keys, "params": others})
    if not any(g.get("optimizer_class") is torch.optim.Muon for g in out):
        raise ValueError(f"optimizer Muon: {type(model).__name__} has no hidden 2-D matrix to orthogonalise (Muon is "
                         "for hidden layers' weights; embeddings and the output head take AdamW); use AdamW")
    return _merge(out), torch.optim.AdamW, adam_kwargs


def _merge(groups: list[dict]) -> list[dict]:
    """One group per distinct set of options (a split of many single-parameter groups would
    otherwise make one group per parameter)."""
    merged: list[dict] = []
    for g in groups:
        key = {k: v for k, v in g.items() if k != "params"}
        for m in merged:
            if {k: v for k, v in m.items() if k != "params"} == key:
                m["params"] = m["params"] + g["params"]
                break
        else:
            merged.append(dict(g))
    return merged
