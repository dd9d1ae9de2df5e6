"""Run in a child process (zeroshard.testing.launch.start_process, or `python -m` as below): saves step 1 cleanly, then SIGKILLs itself at a named point inside
the save of step 2 (``commit.fault_hook``). Writes both steps' parameters first, so the
parent can check that whichever step survives loads exactly.

    python -m tests.support.ckpt_crash_child ROOT POINT OCCURRENCE EXPECT_JSON
"""
from __future__ import annotations

import json
import os
import signal
import sys

import torch

import zeroshard
from tests.support.models import TinyNet, batch
from zeroshard.checkpoint import commit


def build(seed: int = 0) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2, bucket_size_mb=0.001)
    return model, opt


def train_step(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, step: int) -> None:
    model(batch(step, 4)).backward()
    opt.step()
    opt.zero_grad()


def params_hex(model: torch.nn.Module) -> dict[str, str]:
    return {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes().hex()
            for n, p in model.state_dict().items()}


def main(root: str, point: str, occurrence: int, expect_path: str) -> None:
    model, opt = build()
    expect = {}
    for step in (1, 2):
        train_step(model, opt, step)
        expect[step] = params_hex(model)
        if step == 2:
            with open(expect_path, "w") as f:
                json.dump(expect, f)
            seen = {"n": 0}

            def hook(name: str) -> None:
                if name == point:
                    seen["n"] += 1
                    if seen["n"] == occurrence:
                        os.kill(os.getpid(), signal.SIGKILL)
            commit.fault_hook = hook
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt, keep_last=1 if step == 2 else None)
    sys.exit(3)  # the point was never reached: the parent reports it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
