"""A DeepSpeedExamples-style script, launched by tests/train/test_deepspeed_scripts.py under
``torchrun --nproc-per-node 2`` with ``import zeroshard as deepspeed``. As HelloDeepSpeed's
train_bert_ds.py, it never starts the process group itself: ``deepspeed.initialize`` must.

Usage: ds_script_torchrun.py OUT_DIR. Writes OUT_DIR/result-RANK.json and, on rank 0,
OUT_DIR/weights.pt (the stage-3 weights read inside ``GatheredParameters``, as scripts save them).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import zeroshard as deepspeed
from zeroshard.accelerator import get_accelerator

OLD_NAMES = ("reduce_scatter_tensor", "all_gather_into_tensor")


def main(out: str) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    accel = deepspeed.accelerator.get_accelerator()
    device = torch.device(accel.device_name(local_rank))  # (the DeepSpeedExamples idiom)
    before = dist.is_initialized()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
            engine.backward(torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device)))
            engine.step()
    full = deepspeed.full_state_dict(model, rank0_only=False)
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        read = {n: p.detach().float().cpu().clone() for n, p in params.items()}
        if rank == 0:
            torch.save(read, os.path.join(out, "weights.pt"))
    result = {
        "pg_before_initialize": before, "rank": rank, "world": world,
        "backend": dist.get_backend(), "accelerator_backend": accel.communication_backend_name(),
        "device": str(device), "current_device_name": get_accelerator().current_device_name(),
        "read_shapes": {n: list(t.shape) for n, t in read.items()},
        "read_equals_full": {n: bool(torch.equal(read[n], full[n].float())) for n in read},
        "old_collective_warnings": sorted({str(w.message)[:200] for w in caught
                                           if any(name in str(w.message) for name in OLD_NAMES)}),
    }
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
