"""Planning activations under a budget (Note [planning activations]): per block keep / checkpoint /
checkpoint + host / NVMe; the bytes a plan moves are what the offload measures; a budget below
the fully offloaded plan is refused naming the longest sequence and the smallest budget that fit;
``zeroshard estimate --micro-batch --seq-len`` shows the plan."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import zeroshard
from zeroshard.cli import main as cli
from zeroshard.planner.activation_plan import longest_sequence, plan_activations
from zeroshard.planner.activations import block_activation_elements
from zeroshard.planner.model_shape import ModelShape
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support import act_offload_worker as w

SHAPE = ModelShape(n_params=7_000_000_000, n_layers=32, d_model=4096, n_heads=32, vocab=32000)
GiB = 2**30


def test_plan_moves_from_keep_to_checkpoint_to_host_to_nvme_as_memory_shrinks():
    tokens, seq = 8192, 8192
    block = block_activation_elements(SHAPE, tokens, seq, False) * 2
    inp = tokens * SHAPE.d_model * 2
    fixed = 2 * inp + tokens * SHAPE.vocab * 10
    work = tokens * (2 * SHAPE.d_model + 2 * SHAPE.ffn) * 2  # (one block's backward transients)
    roomy = plan_activations(SHAPE, 1, seq, 2, device=200 * GiB, host=0)
    assert roomy.counts() == {"keep": 32} and roomy.moved_per_step == 0
    tight = plan_activations(SHAPE, 1, seq, 2, device=fixed + 3 * block + 20 * inp, host=64 * GiB)
    assert tight.counts().get("checkpoint", 0) > 0 and tight.device_bytes <= fixed + 3 * block + 20 * inp
    least = fixed + block + work + 3 * inp  # (all inputs moved: the running block's record and 2 prefetched back)
    offloaded = plan_activations(SHAPE, 1, seq, 2, device=least, host=10 * inp, nvme=64 * GiB)
    assert offloaded.counts() == {"host": 10, "nvme": 22}
    assert offloaded.device_bytes == least and offloaded.host_bytes == 10 * inp and offloaded.nvme_bytes == 22 * inp
    assert offloaded.moved_per_step == 2 * 32 * inp
    with pytest.raises(ValueError, match=r"longest sequence that fits is (\d+) tokens; at 8192 tokens the device "
                                         rf"needs at least {least / GiB:.2f} GiB") as err:
        plan_activations(SHAPE, 1, seq, 2, device=least - 1, host=64 * GiB)
    longest = int(str(err.value).split("longest sequence that fits is ")[1].split()[0])
    assert longest == longest_sequence(SHAPE, 1, 2, device=least - 1, host=64 * GiB)
    plan_activations(SHAPE, 1, longest, 2, device=least - 1, host=64 * GiB)  # fits
    with pytest.raises(ValueError):
        plan_activations(SHAPE, 1, longest + 1, 2, device=least - 1, host=64 * GiB)


def test_bytes_moved_are_the_plans_prediction():
    cfg = replace(w.CFG, activation_checkpointing=True, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    shape = ModelShape.from_gpt(cfg, sum(p.numel() for p in model.parameters()))
    tokens = 4 * cfg.seq_len
    block = block_activation_elements(shape, tokens, cfg.seq_len, False) * 4
    work, inp = tokens * (2 * 32 + 2 * 128) * 4, tokens * 32 * 4  # (backward's transients; one block's input)
    plan = plan_activations(shape, 4, cfg.seq_len, 4, host=1 << 30, prefetch=1,  # (3 blocks: 2 back at the peak)
                            device=tokens * shape.vocab * 12 + 2 * tokens * 32 * 4 + block + work + 2 * inp)
    assert set(plan.counts()) == {"host"}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=2,
                                  offload_activations=zeroshard.ActivationOffload(where="cpu", min_bytes=0))
    for step in range(2):
        model(*synthetic_batch(step, 4, cfg)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.placement_report()["activations"]["bytes_moved_last_step"] == plan.moved_per_step
    opt.close()


def test_estimate_shows_the_activation_plan(capsys):
    args = ["estimate", "--params", "7B", "--layers", "32", "--hidden", "4096", "--vocab", "32000", "--gpu-memory",
            "80GB", "--cpu-memory", "512GB", "--nvme", "2TB", "--micro-batch", "1"]
    assert cli(args + ["--seq-len", "90000", "--json"]) == 0  # (in process: a subprocess costs an import of torch)
    plan = json.loads(capsys.readouterr().out)["activation_plan"]
    assert plan["seq_len"] == 90000 and plan["moved_per_step"] > 0 and plan["offload_activations"] in ("cpu", "nvme")
    assert sum(plan["blocks"].values()) == 32
    # (planned with the state, Note [joint state and activation plan]: moving the parameters to host memory too
    # keeps more inputs on the GPU than the cheapest choice whose state fits, and is predicted faster)
    joint = plan["joint"]
    assert joint["chosen"] != joint["sequential_config"] and not joint["sequential"], joint
    assert joint["predicted_seconds"] < joint["sequential_seconds"], joint
    assert joint["bytes_moved_per_step"]["activations"] == plan["moved_per_step"]
    assert joint["bytes_moved_per_step"]["state_host_link"] > 0
    assert cli(args + ["--seq-len", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "Activations at --micro-batch 1 x --seq-len 1048576" in out
    assert "the longest sequence that fits is" in out
    assert cli(args + ["--seq-len", "90000"]) == 0
    assert "state and activations planned together: stage 3" in capsys.readouterr().out
