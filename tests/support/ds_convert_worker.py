"""Rank side of tests/checkpoint/test_convert_partitions.py: real DeepSpeed (CPU, gloo, torch_adam) trains a
small model 2 steps on 2 ranks at stages 2 and 3 and saves a checkpoint of each; rank 0 then
writes the variants only DeepSpeed's own classes can (a memo bomb in the client state, a float
``global_steps``, an optimizer file without ``zero_stage``) for the converter to refuse."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

STAGES = (2, 3)
TAG = "global_step2"
BOMB_LEVELS = 40  # (2**40 leaves in a few hundred bytes of pickle)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 2e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def tag_dir(out: str, name: str) -> str:
    return os.path.join(out, name, TAG)


def _variant(out: str, name: str, file: str, edit) -> None:
    shutil.copytree(os.path.join(out, "stage2"), os.path.join(out, name))
    path = os.path.join(tag_dir(out, name), file)
    obj = torch.load(path, weights_only=False)
    edit(obj)
    torch.save(obj, path)


def run(rank: int, world: int, out: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in STAGES:
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"stage{stage}"), tag=TAG, client_state={"note": "kept"})
        if stage == 2:
            bomb: list = [0]
            for _ in range(BOMB_LEVELS):
                bomb = [bomb, bomb]
            engine.save_checkpoint(os.path.join(out, "bomb"), tag=TAG, client_state={"bomb": bomb})
        dist.barrier()
    if rank == 0:
        _variant(out, "float-steps", "mp_rank_00_model_states.pt", lambda ms: ms.update(global_steps=2.5))
        _variant(out, "no-zero-stage", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 lambda o: o["optimizer_state_dict"].pop("zero_stage"))
    dist.barrier()
