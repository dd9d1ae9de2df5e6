"""``python -m zeroshard.demo``: a small transformer trained on 2 gloo ranks at stages 0-3,
printing each rank's model-state memory and the loss, then a checkpoint and a resume.

1. Every stage starts from the same weights and sees the same global batch, so the loss
   columns agree while the memory column shrinks.
2. Stage 2 trains 8 steps and saves a sharded checkpoint at step 4; fresh processes (as
   after a crash) resume from the latest checkpoint and must end bit-identical; then one
   process at stage 0 loads the same 2-rank checkpoint (resharding) and continues.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import zeroshard
from zeroshard.testing.launch import spawn
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

CONFIG = GPTConfig(vocab=256, d_model=128, n_layers=4, n_heads=4, seq_len=32)


RESUME_INTRO = ("\nzeroshard demo: checkpoint and resume, a separate run: stage 2 on fresh ranks, 8 steps, a "
                "checkpoint at step 4 in the temporary folder {root} (removed at the end). Its losses are this "
                "run's, not the table's: the table ran each stage for --steps steps from the same start, this run "
                "stops at step 8; \"uninterrupted\" below is this run's own loss at step 8, before the resume.")


def _log(rank: int, msg: str) -> None:
    # One line per rank, printed in rank order so the output reads as a table.
    for r in range(dist.get_world_size()):
        if r == rank:
            print(msg, flush=True)
        dist.barrier()


def _steps(model, opt, rank: int, world: int, start: int, stop: int, global_batch: int) -> list[float]:
    local = global_batch // world
    losses = []
    for step in range(start, stop):
        x, y = synthetic_batch(step % 4, global_batch, CONFIG)  # 4 batches, revisited: loss falls
        loss = model(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _build(stage: int):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1, stage=stage)


def _weights(model) -> dict:
    state = zeroshard.full_state_dict(model, rank0_only=False)
    if state is None:  # (rank0_only=False: every rank gets the weights)
        raise RuntimeError("full_state_dict(rank0_only=False) gave this rank no weights")
    return {k: v.contiguous() for k, v in state.items()}


def header(n_params: int, world: int, steps: int, global_batch: int) -> str:
    """What the stage table shows, and the symbols of its formulas."""
    return (f"TinyGPT {n_params / 1e6:.2f}M parameters, {world} gloo ranks, global batch {global_batch}, AdamW, "
            f"fp32, {steps} steps per stage.\n"
            f"Bytes of model states per rank, with Ψ = {n_params:,} parameters and N = {world} ranks: stage 0 16Ψ "
            "(4 params + 4 grads + 8 Adam moments), 1 8Ψ+8Ψ/N, 2 4Ψ+12Ψ/N, 3 16Ψ/N.\n"
            "\"master 0.00 MiB\": in fp32 the parameters are themselves the fp32 master weights, so there is no "
            "separate copy (mixed_precision=\"bf16\" adds one, 4 bytes per owned element).")


def _stages(rank: int, world: int, steps: int, global_batch: int) -> None:
    if rank == 0:
        n = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
        print(header(n, world, steps, global_batch), flush=True)
    for stage in (0, 1, 2, 3):
        model, opt = _build(stage)
        losses = _steps(model, opt, rank, world, 0, steps, global_batch)
        rep = opt.memory_report()
        _log(rank, f"stage {stage} rank {rank}: {rep} | model states {rep.model_states / 2**20:6.2f} MiB"
                   + (f" | loss {losses[0]:.3f} -> {losses[-1]:.3f}" if rank == 0 else ""))


def _train_and_save(rank: int, world: int, root: str, global_batch: int, out: list) -> None:
    model, opt = _build(2)
    _steps(model, opt, rank, world, 0, 4, global_batch)
    zeroshard.save_checkpoint(root, 4, model=model, optimizer=opt)
    losses = _steps(model, opt, rank, world, 4, 8, global_batch)
    weights = _weights(model)
    if rank == 0:
        print(f"stage 2, {world} ranks: trained 8 steps, checkpoint saved at step 4 in {root}: "
              f"{sorted(os.listdir(os.path.join(root, 'step-00000004')))}", flush=True)
        save_file(weights, os.path.join(root, "uninterrupted.safetensors"), {"loss": repr(losses[-1])})


def _resume(rank: int, world: int, root: str, global_batch: int, stage: int) -> None:
    model, opt = _build(stage)
    model.apply(lambda m: [torch.nn.init.zeros_(p) for p in m.parameters(recurse=False)])
    zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    losses = _steps(model, opt, rank, world, 4, 8, global_batch)
    weights = _weights(model)
    if rank == 0:
        path = os.path.join(root, "uninterrupted.safetensors")
        ref = load_file(path)
        with safe_open(path, "pt") as f:
            ref_loss = float(f.metadata()["loss"])
        same = all(torch.equal(weights[k], ref[k]) for k in ref)
        diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
        how = "bit-identical" if same else f"max |diff| {diff:.1e} (the sums run in another order)"
        print(f"resumed from {zeroshard.latest_checkpoint(root)} at stage {stage} on {world} rank(s): loss at "
              f"step 8 {losses[-1]:.4f} (the uninterrupted run's: {ref_loss:.4f}); weights vs uninterrupted: {how}",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zeroshard.demo", description=__doc__)  # (not "__main__.py")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=8)
    a = ap.parse_args(argv)
    if a.global_batch % a.world_size:
        raise SystemExit(f"--global-batch {a.global_batch} must be divisible by --world-size {a.world_size}")
    _prepare_kernels()
    print(f"zeroshard demo: starting {a.world_size} gloo ranks (each imports torch, a few seconds)", flush=True)
    spawn(_stages, a.world_size, a.steps, a.global_batch)
    with tempfile.TemporaryDirectory(prefix="zeroshard-demo-") as root:
        print(RESUME_INTRO.format(root=root), flush=True)
        spawn(_train_and_save, a.world_size, root, a.global_batch, [])
        print("zeroshard demo: resuming in fresh processes, as after a crash", flush=True)
        spawn(_resume, a.world_size, root, a.global_batch, 2)   # fresh processes, as after a crash
        _resume_single(root, a.global_batch)                    # reshard: 1 process, stage 0
    print(f"zeroshard demo: done; the temporary checkpoint folder {root} was removed", flush=True)


def _prepare_kernels() -> None:
    # The first run on a machine compiles the fused Adam kernel (with a progress line every
    # 10 s); doing it here, once, lets the ranks load it from the cache instead of one compiling
    # while the other waits, both printing progress.
    from zeroshard.ops._loader import REGISTRY

    print("zeroshard demo: loading the fused Adam kernel (compiled on first use, then cached)", flush=True)
    REGISTRY.cpu()


def _resume_single(root: str, global_batch: int) -> None:
    _resume(0, 1, root, global_batch, 0)


if __name__ == "__main__":
    main()
