"""A stage-3 NVMe run that reports what the host buffer pool did (tests/offload/test_host_pool.py
runs it in the test process and, with the pool off, in a child process)."""
from __future__ import annotations

import torch

import zeroshard
from zeroshard.io.host_pool import HOST_POOL
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch


def train_stage3_nvme(path: str, steps: int = 4) -> tuple[list[float], list[int], int, int]:
    """Losses, bytes the pool mapped anew in each step, bytes reused, and what it held after
    the run, of a stage-3 NVMe run (the pool is emptied by ``close``)."""
    cfg = GPTConfig(vocab=512, d_model=512, n_layers=3, n_heads=4, seq_len=16)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=path)
    zeroshard.init_meta_weights(model, seed=0)
    HOST_POOL.trim()
    reused = HOST_POOL.reused
    mapped: list[int] = []
    losses = []
    for step in range(steps):
        before = HOST_POOL.mapped
        loss = model(*synthetic_batch(step, 2, cfg))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        mapped.append(HOST_POOL.mapped - before)
    held = HOST_POOL.held
    if held > HOST_POOL.max_buffers * max(u.flat.numel() * u.flat.element_size() + 4096 for u in opt.all_units) \
            + 64 * 2**20:
        raise RuntimeError(f"{held} bytes pooled: over its bound")
    opt.close()
    if HOST_POOL.held:
        raise RuntimeError(f"{HOST_POOL.held} bytes pooled after close")
    return losses, mapped, HOST_POOL.reused - reused, held
