"""Large-model start-up at stage 3: peak resident memory per rank while a model built on the
meta device is loaded from a Hugging Face style safetensors directory, against the size of
the full model (and against loading it normally).

    python benchmarks/bench_meta_load.py [--d-model 1024 --layers 8 --world-size 2]

Each rank reports its peak RSS (ru_maxrss) minus its resident memory after imports; the ratio to the model's fp32
bytes is the figure (1.0 would mean a rank held the whole model once).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import psutil
import torch
from safetensors.torch import save_file

import zeroshard
from zeroshard.testing.launch import spawn
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up() -> None:
    """Builds and runs a tiny model first, so lazily imported machinery (meta-device support,
    attention kernels: ~70 MiB here) is in the baseline rather than counted as model memory."""
    tiny = GPTConfig(vocab=16, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    with torch.device("meta"):
        TinyGPT(tiny)
    with torch.no_grad():
        TinyGPT(tiny)(synthetic_batch(0, 1, tiny)[0])


def _rank(rank: int, world: int, cfg: GPTConfig, directory: str, out: str, meta: bool) -> None:
    _warm_up()
    base = psutil.Process().memory_info().rss  # resident now (the import peak may be higher)
    if meta:
        with torch.device("meta"):
            model = TinyGPT(cfg)
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, stage=3)
        zeroshard.load_safetensors(model, directory)
    else:  # the usual way: every rank builds and loads the whole model
        from safetensors.torch import load_file
        model = TinyGPT(cfg)
        model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")))
    with torch.no_grad():
        logits = model(synthetic_batch(0, 2, cfg)[0])
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"growth": _maxrss() - base, "checksum": float(logits.double().sum())}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--world-size", type=int, default=2)
    a = ap.parse_args()
    cfg = GPTConfig(vocab=256, d_model=a.d_model, n_layers=a.layers, n_heads=16, seq_len=64)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(d, "model.safetensors"))
        del model
        res = {}
        for meta in (False, True):
            out = os.path.join(d, f"res-{meta}")
            spawn(_rank, a.world_size, cfg, d, out, meta)
            res[meta] = [json.load(open(f"{out}.{r}")) for r in range(a.world_size)]
    print(f"model {nbytes / 2**20:.0f} MiB fp32, world size {a.world_size}")
    print("| load | peak RSS growth per rank (MiB) | ÷ model size |\n|---|---|---|")
    for meta, label in ((False, "eager build + load_state_dict"), (True, "meta + stage 3 + load_safetensors")):
        g = max(r["growth"] for r in res[meta])
        print(f"| {label} | {g / 2**20:.0f} | {g / nbytes:.2f} |")
    same = len({r["checksum"] for rs in res.values() for r in rs}) == 1
    print(f"outputs equal: {same}")


if __name__ == "__main__":
    main()
