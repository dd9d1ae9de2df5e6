"""What a converted checkpoint holds, to compare two conversions: every tensor by its key and
the small state beside them."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from tests.support.asserts import assert_same
from zeroshard.checkpoint import dcp_metadata
from zeroshard.checkpoint.dcp_read import DcpSource


def contents(step_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors by key, small state) of a native or DCP step directory. The RNG states are left
    out: a checkpoint saved at another world size takes the converting process's."""
    if dcp_metadata.is_dcp_dir(step_dir):
        src = DcpSource(step_dir)
        tensors, small = {}, {}
        for key in src.entries:
            value = src.value(key)
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif not key.startswith("train_state.rng."):
                small[key] = value
        return tensors, small
    tensors = {}
    for f in sorted(os.listdir(step_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(step_dir, f)))
    body = json.load(open(os.path.join(step_dir, "manifest.json")))["manifest"]
    small = {k: v for k, v in body.items() if k != "files"}
    for meta in small["tensors"].values():  # (which file a piece is in: the writer's choice)
        for p in meta["pieces"]:
            p.pop("file")
    return tensors, small


def assert_same_checkpoint(got: str, want: str) -> None:
    """Every tensor ``torch.equal`` (dtype and shape too), and the same small state."""
    (gt, gs), (wt, ws) = contents(got), contents(want)
    assert sorted(gt) == sorted(wt), (sorted(set(gt) ^ set(wt)))
    assert {k: (t.dtype, tuple(t.shape)) for k, t in gt.items()} == {k: (t.dtype, tuple(t.shape)) for k, t in wt.items()}
    assert_same(gt, wt, f"{got} against {want}")
    if "param_groups" in ws:  # (the order of a group's names follows the model's)
        assert gs == ws, json.dumps([gs, ws], default=str)[:4000]
    else:
        assert gs == ws, sorted(k for k in set(gs) | set(ws) if gs.get(k) != ws.get(k))
