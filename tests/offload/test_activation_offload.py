"""offload_activations='cpu'|'nvme': the covered blocks' saved tensors (a checkpointed block's
input) leave the device after the block's forward and come back for its backward; gradients
and weights are bit-identical to the run without offload, dropout on, stages 0-3."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import zeroshard
from zeroshard.testing.toy import TinyGPT

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same
from tests.support.dist_results import run_ranks


@pytest.mark.parametrize("stage,where,ckpt", [(0, "nvme", False), (1, "cpu", True), (2, "nvme", True),
                                              (3, "nvme", False)])
def test_same_bits_as_without_offload_one_rank(stage, where, ckpt, tmp_path):
    want = w.train(stage, None, ckpt, steps=4)  # (8 steps on two ranks below)
    got = w.train(stage, where, ckpt, steps=4, directory=str(tmp_path))
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}")
    assert_same(got["weights"], want["weights"], "weights after 4 steps")
    moved = got["report"]["bytes_out_last_step"]
    if ckpt:  # exactly each block's input
        assert moved == w.predicted_bytes(True)
    else:  # every block's saved tensors: many times the inputs
        assert moved > 5 * w.predicted_bytes(True)
    assert got["report"]["bytes_in_last_step"] == moved
    assert got["memory"].activations_moved == 2 * moved
    assert "activations moved per step" in str(got["memory"])
    if where == "nvme":
        assert os.listdir(str(tmp_path)) == [], "close() removes the activation directory"


def test_same_bits_on_two_gloo_ranks(tmp_path):
    for rank in run_ranks(w.parity_on_ranks, 2, str(tmp_path)):
        for case, r in rank.items():
            assert r["grads"] and r["weights"], case
            assert r["moved"] > 0 and r["back"] == r["moved"], case
            if case.endswith("True"):
                assert r["moved"] == w.predicted_bytes(True, world=2), case


def test_files_exist_between_forward_and_backward(tmp_path):
    cfg = w.CFG
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=2, nvme_path=str(tmp_path),
                                  offload_activations=zeroshard.ActivationOffload(where="nvme", min_bytes=0))
    x, y = w.synthetic_batch(0, 2, cfg)
    loss = model(x, y)
    files = os.listdir(opt.engine.activations.directory)
    assert len(files) == cfg.n_layers  # one file per block call
    loss.backward()
    del loss
    assert os.listdir(opt.engine.activations.directory) == []  # the graph let go: the files go
    with torch.no_grad():
        model(x, y)  # (no graph: nothing moves)
    assert os.listdir(opt.engine.activations.directory) == []
    opt.close()


def test_parameters_and_small_tensors_stay():
    torch.manual_seed(0)
    model = TinyGPT(w.CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=0,
                                  offload_activations=zeroshard.ActivationOffload(where="cpu", min_bytes=1 << 30))
    x, y = w.synthetic_batch(0, 2, w.CFG)
    model(x, y).backward()
    assert opt.placement_report()["activations"]["bytes_out_this_step"] == 0  # all under min_bytes
    opt.close()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=0,
                                  offload_activations=zeroshard.ActivationOffload(where="cpu", min_bytes=0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (the flat units' storage)
    packed: list = []
    a = opt.engine.activations
    pack = a._pack
    a._pack = lambda t: (lambda r: (packed.append((t, r)), r)[1])(pack(t))  # (each save and what it became)
    loss = model(x, y)
    weights = [(t, r) for t, r in packed if t.untyped_storage().data_ptr() in params]
    assert weights, "the blocks' linear layers save their weights"
    assert all(r is t for t, r in weights), "a parameter was moved"
    assert any(r is not t for t, r in packed), "activations were moved"
    loss.backward()
    opt.close()


def test_blocks_named_by_module_name_or_class():
    cfg = replace(w.CFG, activation_checkpointing=True)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    for blocks, want in ((("blocks.1",), ["blocks.1"]), (("Block",), ["blocks.0", "blocks.1", "blocks.2"])):
        opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=1, offload_activations=zeroshard.
                                      ActivationOffload(where="cpu", blocks=blocks, min_bytes=0))
        model(*w.synthetic_batch(0, 4, cfg)).backward()
        report = opt.placement_report()["activations"]
        assert report["blocks"] == want
        assert report["bytes_out_this_step"] == len(want) * w.predicted_bytes(True) // cfg.n_layers
        opt.close()
