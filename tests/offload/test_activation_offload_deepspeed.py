"""The DeepSpeed front's activation checkpointing: the config's ``activation_checkpointing`` keys
(cpu_checkpointing -> host offload of checkpointed inputs; the others accepted without effect
or refused by name) and ``deepspeed.checkpointing.configure`` / ``checkpoint`` after
``import zeroshard as deepspeed``."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.testing.toy import Block, synthetic_batch
from zeroshard.train.deepspeed_config import translate

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

CFG = replace(w.CFG, dropout=0.1)
SECTION = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
           "number_checkpoints": 3, "synchronize_checkpoint_boundary": True}


class MegatronStyle(nn.Module):
    """A model that checkpoints its layers through ``deepspeed.checkpointing.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(CFG.vocab, CFG.d_model)
        self.layers = nn.ModuleList(Block(CFG) for _ in range(CFG.n_layers))
        self.head = nn.Linear(CFG.d_model, CFG.vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_config_keys_map_or_say_why():
    with pytest.warns(UserWarning, match="without effect") as noted:
        plan = translate({"zero_optimization": {"stage": 2}, "activation_checkpointing": SECTION})
    assert plan.zero["offload_activations"] == "cpu"
    assert sorted(plan.noted) == sorted(f"activation_checkpointing.{k}" for k in SECTION if k != "cpu_checkpointing")
    assert "leaves the device whole" in str(noted[0].message)
    with pytest.raises(ValueError, match=r"does not support: \['activation_checkpointing.partition_activations'\]"):
        translate({"activation_checkpointing": {"partition_activations": True}})
    with pytest.raises(ValueError, match="number_checkpoints=0 must be an int >= 1"):
        translate({"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 0}})
    with pytest.raises(ValueError, match="does not support.*activation_checkpointing.profile"):
        translate({"activation_checkpointing": {"profile": True}})
    assert "offload_activations" not in translate({"activation_checkpointing": {"cpu_checkpointing": False}}).zero


def _train(config_section: dict | None, steps: int = 2) -> tuple[list, dict, dict | None]:
    torch.manual_seed(0)
    model = MegatronStyle()
    cfg = {"train_micro_batch_size_per_gpu": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}}
    if config_section is not None:
        cfg["activation_checkpointing"] = config_section
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = deepspeed.initialize(model=model, config=cfg)
        deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
    torch.manual_seed(1)
    grads = []
    for step in range(steps):
        engine.backward(engine(*synthetic_batch(step, 32, CFG)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        engine.step()
    report = opt.placement_report().get("activations")
    deepspeed.checkpointing.reset()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, report


def test_cpu_checkpointing_moves_the_inputs_with_the_same_bits():
    want_grads, want, none = _train(None)
    assert none is None
    got_grads, got, report = _train({"cpu_checkpointing": True, "number_checkpoints": 3})
    for step, (g, r) in enumerate(zip(got_grads, want_grads)):
        assert_same(g, r, f"gradients of step {step}")
    assert_same(got, want, "weights")
    assert report["where"] == "cpu" and report["blocks"] == ["layers.0", "layers.1", "layers.2"]
    # each layer's input: 32 x 16 tokens x 32 fp32 = 64 KiB, at the default threshold
    assert report["bytes_out_last_step"] == report["bytes_in_last_step"] == 3 * 32 * 16 * 32 * 4


def test_checkpoint_and_configure_without_an_optimizer():
    torch.manual_seed(0)
    layer = Block(replace(CFG, dropout=0.2))
    x = torch.randn(2, 16, CFG.d_model, requires_grad=True)
    torch.manual_seed(5)
    layer(x).square().sum().backward()
    want = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    x.grad = None
    layer.zero_grad()
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True, num_checkpoints=1)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(5)
    out = deepspeed.checkpointing.checkpoint(layer, x)
    out.square().sum().backward()
    assert_same({"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}, want, "gradients")
    with pytest.raises(ValueError, match="partition_activations=True.*checkpoint_in_cpu=True instead"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    with pytest.raises(ValueError, match="profile=True"):
        deepspeed.checkpointing.configure(None, profile=True)
    deepspeed.checkpointing.reset()
    assert not deepspeed.checkpointing.is_configured()
