"""A DeepSpeed config trains exactly like the equivalent zeroshard arguments (2 gloo ranks),
and keys zeroshard does not support are reported by name."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import zeroshard
from tests.support import finetune_ds_worker
from zeroshard.testing.launch import spawn


def test_deepspeed_config_matches_zeroshard_arguments(tmp_path):
    out = str(tmp_path / "ds")
    spawn(finetune_ds_worker.run, 2, out, threads=1)
    for rank in range(2):
        with open(f"{out}.rank{rank}") as f:
            results = json.load(f)
        assert set(results) == set(finetune_ds_worker.CASES)
        for name, r in results.items():
            assert r["lrs_ds"] == r["lrs_hand"], (name, r["lrs_ds"], r["lrs_hand"])
            assert r["same_params"], f"{name}: parameters differ between the DeepSpeed config and the arguments"
    plans = {name: r["plan"] for name, r in results.items()}
    assert plans["stage2-adamw-cosine"] == {"clip": 0.5, "accum": 2, "micro": 2}
    # train_batch_size 8 on 2 ranks with no accumulation: 4 sequences per rank.
    assert plans["stage1-adam-bf16-decay"] == {"clip": None, "accum": 1, "micro": 4}


def test_unsupported_keys_are_reported_by_name(tmp_path):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgard": True}},
              "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2},
              "activation_checkpointing": {"partition_activations": True},
              "fp16": {"enabled": True, "loss_scale": 128}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        zeroshard.initialize(torch.nn.Linear(4, 4), config=str(path))
    for key in ("optimizer.params.amsgard", "zero_optimization.zero_hpz_partition_size",
                "activation_checkpointing.partition_activations", "fp16.loss_scale"):
        assert key in str(err.value)
    # strict=False trains without them, still naming each one.
    with pytest.warns(UserWarning, match="zero_hpz_partition_size"):
        model, opt, sched = zeroshard.initialize(torch.nn.Linear(4, 4), config=str(path), strict=False)
    assert isinstance(opt, zeroshard.ZeroOptimizer) and sched is None


def test_noted_keys_warn_by_name_and_change_nothing():
    config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 1, "overlap_comm": False},
              "wall_clock_breakdown": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, opt, _ = zeroshard.initialize(torch.nn.Linear(4, 4), config)
    text = " ".join(str(w.message) for w in caught)
    assert "zero_optimization.overlap_comm" in text and "wall_clock_breakdown" in text
    # DeepSpeed's AdamW defaults to weight_decay 0 (torch's to 0.01).
    assert opt.stage == 1 and opt.param_groups[0]["weight_decay"] == 0.0
