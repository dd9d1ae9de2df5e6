"""One rank of ``bench memory``: trains each configuration for a few steps, in turn, in one
process, and records its peak bytes by category.

Model-state categories come from ``ZeroOptimizer.memory_report()`` (tensor accounting),
sampled after every backward hook, forward of every module, and step, keeping each
category's maximum: that catches the stage-3 gather buffers and the stage-2 buckets at
their peak, not just at rest. Peak RSS is reset between configurations (``rss.py``); on a
GPU, ``torch.cuda.max_memory_allocated`` is reset too.
"""
from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroshard.bench.configs import MemConfig
from zeroshard.bench.models import ModelSource
from zeroshard.offload.process_rss import current_rss, peak_rss, reset_peak_rss

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


class _PeakSampler:
    """Keeps the maximum of each ``memory_report()`` category over every sample."""

    def __init__(self, opt: "ZeroOptimizer") -> None:
        self.opt = opt
        self.peak: dict[str, int] = {}

    def sample(self, *_: Any) -> None:
        for k, v in self.opt.memory_report().as_dict().items():
            self.peak[k] = max(self.peak.get(k, 0), int(v))

    def attach(self, model: torch.nn.Module) -> list:
        handles = [m.register_forward_hook(self.sample) for m in model.modules()]
        handles += [p.register_post_accumulate_grad_hook(self.sample) for p in model.parameters() if p.requires_grad]
        return handles


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def measure(source: ModelSource, cfg: MemConfig, steps: int, global_batch: int, mixed_precision: str | None,
            rank: int, world: int, nvme_dir: str) -> dict:
    import zeroshard

    device = _device(rank)
    gc.collect()
    resettable = reset_peak_rss()
    rss0 = current_rss()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cuda0 = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    torch.manual_seed(0)
    model = source.build().to(device)
    try:
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, mixed_precision=mixed_precision,
                                      **cfg.optimizer_kwargs(nvme_dir))
    except (RuntimeError, ValueError, NotImplementedError, OSError) as exc:
        # Every rank raises the same error before any collective, so nobody is left waiting.
        return {"error": str(exc).strip().splitlines()[0][:300]}
    sampler = _PeakSampler(opt)
    handles = sampler.attach(model)
    for step in range(steps):
        x, y = source.batch(step, global_batch, rank, world, device)
        source.loss(model, x, y).backward()
        sampler.sample()
        opt.step()
        sampler.sample()
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    out = {"report": sampler.peak, "peak_rss": peak_rss(), "rss_before": rss0,
           "rss_growth": peak_rss() - rss0, "rss_reset": resettable}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated() - cuda0
    del opt, model, sampler
    gc.collect()
    return out


def worker(rank: int, world: int, source: ModelSource, configs: list[MemConfig], steps: int,
           global_batch: int, mixed_precision: str | None, out_dir: str) -> None:
    """Entry point for ``zeroshard.testing.launch.spawn``: writes ``out_dir/rank-R.json``."""
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"zeroshard-nvme-r{rank}-") as nvme_dir:
        # One unrecorded step first: thread pools, kernel workspaces and gloo's buffers are
        # allocated once per process and would otherwise count against the first configuration.
        measure(source, configs[0], 1, global_batch, mixed_precision, rank, world, nvme_dir)
        for cfg in configs:
            results[cfg.label] = measure(source, cfg, steps, global_batch, mixed_precision, rank, world, nvme_dir)
            if world > 1:
                dist.barrier()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
