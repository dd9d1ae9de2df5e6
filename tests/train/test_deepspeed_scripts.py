"""The DeepSpeed scripts people copy, on ``import zeroshard as deepspeed`` (issue 39, section 1):
the accelerator module, ``initialize`` starting the process group under torchrun, Muon from a
config, whole parameters inside ``GatheredParameters`` at stage 3, what ``initialize`` refuses,
and the RNG switch of ``load_checkpoint``.

One torchrun launch (2 processes, gloo; tests/support/ds_script_torchrun.py) covers what needs real
ranks; the rest runs in this process.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import zeroshard
import zeroshard as deepspeed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "ds_script_torchrun.py")


def _config(**extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory) -> tuple[str, list[dict]]:
    from zeroshard.testing.launch import free_port
    out = str(tmp_path_factory.mktemp("ds_torchrun"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), SCRIPT, out]
    # (native: gloo's reduce-scatter and all-gather themselves, not the all-reduce emulation gloo
    # gets by default, so torch's names for them are called)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "ZEROSHARD_COLLECTIVES": "native"}
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return out, [json.load(open(os.path.join(out, f"result-{r}.json"))) for r in range(2)]


def test_initialize_under_torchrun_starts_the_process_group(torchrun):
    _, results = torchrun
    for rank, res in enumerate(results):
        assert not res["pg_before_initialize"] and (res["rank"], res["world"]) == (rank, 2)
        assert res["backend"] == res["accelerator_backend"] == "gloo"
        assert res["device"] == res["current_device_name"] == "cpu"


def test_gathered_parameters_read_whole_at_stage3_and_rank0_saves_them(torchrun):
    out, results = torchrun
    for res in results:
        assert res["read_shapes"] == {"0.weight": [16, 8], "0.bias": [16], "2.weight": [4, 16], "2.bias": [4]}
        assert all(res["read_equals_full"].values()), res["read_equals_full"]
    saved = torch.load(os.path.join(out, "weights.pt"), weights_only=True)  # a plain file, whole tensors
    assert {n: list(t.shape) for n, t in saved.items()} == results[0]["read_shapes"]
    assert all(type(t) is torch.Tensor for t in saved.values())


def test_collectives_use_torchs_current_names(torchrun):
    """torch 2.13 warns on every reduce_scatter_tensor / all_gather_into_tensor call."""
    for res in torchrun[1]:
        assert res["old_collective_warnings"] == []


# -- one process --------------------------------------------------------------------------------
def _surface(accel: object) -> None:
    for name in ("device_name", "current_device_name", "is_available", "device_count", "communication_backend_name",
                 "synchronize", "manual_seed", "manual_seed_all", "pin_memory", "is_pinned", "on_accelerator",
                 "memory_allocated", "max_memory_allocated", "empty_cache", "total_memory", "available_memory",
                 "is_bf16_supported", "is_fp16_supported", "supported_dtypes", "current_device", "set_device",
                 "get_rng_state", "set_rng_state", "range_push", "range_pop", "device"):
        assert callable(getattr(accel, name)), name


def test_accelerator_answers_the_common_surface_on_cpu():
    from zeroshard.accelerator import get_accelerator
    from zeroshard.deepspeed_compat.accelerator import Accelerator
    assert deepspeed.accelerator.get_accelerator() is get_accelerator()
    cpu = Accelerator(cuda=False)
    _surface(cpu)
    assert (cpu.device_name(), cpu.device_name(0), cpu.current_device_name()) == ("cpu", "cpu", "cpu")
    assert cpu.is_available() and cpu.device_count() >= 1 and cpu.communication_backend_name() == "gloo"
    t = torch.ones(3)
    assert cpu.pin_memory(t) is t and cpu.on_accelerator(t) and cpu.memory_allocated() > 0
    cpu.manual_seed(5)
    a = torch.rand(2)
    cpu.manual_seed(5)
    assert torch.equal(a, torch.rand(2))
    cpu.synchronize()
    with pytest.raises(AttributeError, match="create_op_builder is not provided"):
        cpu.create_op_builder("FusedAdam")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accelerator_answers_the_common_surface_on_cuda():
    from zeroshard.deepspeed_compat.accelerator import Accelerator
    gpu = Accelerator(cuda=True)
    _surface(gpu)
    assert deepspeed.accelerator.get_accelerator().device_name() == "cuda"
    assert gpu.device_name(0) == "cuda:0" and gpu.current_device_name() == f"cuda:{torch.cuda.current_device()}"
    assert gpu.communication_backend_name() == "nccl" and gpu.device_count() == torch.cuda.device_count()
    t = gpu.pin_memory(torch.ones(3))
    assert gpu.is_pinned(t) and not gpu.on_accelerator(t) and gpu.on_accelerator(t.cuda())
    gpu.manual_seed(5)
    a = torch.rand(2, device="cuda")
    gpu.manual_seed(5)
    assert torch.equal(a, torch.rand(2, device="cuda"))
    gpu.synchronize()
    assert gpu.total_memory() > 0 and gpu.memory_allocated() > 0


def test_muon_from_a_deepspeed_config_builds_as_zeroshard_initialize_does():
    cfg = _config(optimizer={"type": "Muon", "params": {"lr": 2e-2, "adam_lr": 1e-3, "adam_betas": [0.9, 0.95],
                                                        "adam_eps": 1e-7, "adam_weight_decay": 0.01}})
    model = _model()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    model2 = _model()
    _, opt2, _ = zeroshard.initialize(model2, cfg)

    def groups(o: torch.optim.Optimizer) -> list:
        return [(g.get("optimizer_class"), g["lr"], len(g["params"]), g.get("betas"), g.get("eps"), g["weight_decay"])
                for g in o.param_groups]
    assert groups(opt) == groups(opt2)
    assert groups(opt)[0][:3] == (torch.optim.Muon, 2e-2, 2) and groups(opt)[1][1:] == (1e-3, 2, (0.9, 0.95), 1e-7, 0.01)
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    before = model[0].weight.detach().clone()
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert not torch.equal(before, model[0].weight.detach())


def test_initialize_refuses_what_would_silently_train_wrong():
    model = _model()
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"model_parameters=\.\.\.\): 2 tensor\(s\) are not parameters"):
        deepspeed.initialize(model=model, model_parameters=other.parameters(), config=_config())
    with pytest.raises(ValueError, match=r"model_parameters"):
        zeroshard.initialize(model, _config(), model_parameters=[{"params": list(other.parameters())}])
    for section in ("fp16", "bf16"):
        with pytest.raises(ValueError, match=rf'{section}.enabled is "auto".*true or false'):
            deepspeed.initialize(model=model, config=_config(**{section: {"enabled": "auto"}}))
    cfg = _config(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 20}})
    with pytest.raises(ValueError, match=r"warmup_num_steps=20 is more than scheduler.params.total_num_steps=10"):
        deepspeed.initialize(model=model, config=cfg)
    from zeroshard.train.schedules import WarmupDecayLR
    with pytest.raises(ValueError, match=r"warmup_num_steps=20 is more than .*total_num_steps=10"):
        WarmupDecayLR(torch.optim.SGD(model.parameters(), lr=0.1), 10, warmup_num_steps=20)
    # the model was never taken: a correct call still builds
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    assert engine.module is model


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


@pytest.mark.parametrize("load_rng", [True, False])
def test_load_checkpoint_restores_rng_unless_asked_to_keep_deepspeeds_behaviour(tmp_path, load_rng):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed.initialize(model=model, config=_config())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    engine.save_checkpoint(str(tmp_path))
    after_save = _draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    script_seeded = _draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    if load_rng:
        engine.load_checkpoint(str(tmp_path))
        assert _draws() == after_save  # the saved streams continue
    else:
        engine.load_checkpoint(str(tmp_path), load_rng=False)
        assert _draws() == script_seeded  # DeepSpeed's behaviour: the script's seeding stands
    with pytest.raises(TypeError, match="load_rng"):
        engine.load_checkpoint(str(tmp_path), load_rng="no")
