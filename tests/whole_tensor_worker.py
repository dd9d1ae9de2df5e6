"""Whole-tensor optimizers (torch.optim.Muon with AdamW, Adafactor) under ZeroOptimizer against
the same torch classes in one process on the same global batch (tests/test_whole_tensor.py)."""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

import zeroshard

STEPS = 8
LOCAL_BATCH = 2
MAX_NORM = 0.05  # (clipping bites every step: checked)
NO_CLIP = 1e9


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def batch(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (n, 12), generator=g)


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's usual recipe: the hidden 2-D matrices (not embeddings or the head)."""
    return p.ndim == 2 and ".layers." in name


def groups(model: torch.nn.Module, recipe: str, zero: bool) -> Any:
    if recipe == "adafactor":
        return list(model.parameters())
    mats = [p for n, p in model.named_parameters() if is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_matrix(n, p)]
    muon = {"params": mats, "lr": 0.02}
    return [{**muon, "optimizer_class": torch.optim.Muon} if zero else muon, {"params": rest, "lr": 3e-3}]


def reference(recipe: str, world: int, max_norm: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = llama()
    if recipe == "adafactor":
        opts = [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    else:
        mats, rest = groups(model, recipe, zero=False)
        opts = [torch.optim.Muon([mats]), torch.optim.AdamW([rest])]
    norms = []
    for step in range(STEPS):
        ids = batch(step, LOCAL_BATCH * world)
        # The global batch's gradient as data parallelism computes it: each rank's share's
        # gradient summed, then averaged (the same arithmetic, so the same bits)
        for r in range(world):
            part = ids[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
            model(input_ids=part, labels=part).loss.backward()
        for p in model.parameters():
            p.grad.mul_(1.0 / world)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def zero_run(recipe: str, stage: int, rank: int, world: int,
             max_norm: float) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    model = llama()
    cls = torch.optim.Adafactor if recipe == "adafactor" else torch.optim.AdamW
    # (Muon orthogonalises in bf16, so an AdamW half that differs from torch's in the last bit -
    # the fused kernel's - moves the next gradients enough to flip bf16 roundings: torch's own
    # AdamW on the flat slices keeps the comparison exact)
    kw = {"lr": 1e-2} if recipe == "adafactor" else {"fused_adam": False}
    opt = zeroshard.ZeroOptimizer(groups(model, recipe, zero=True), cls, stage=stage, module=model, **kw)
    norms = []
    for step in range(STEPS):
        ids = batch(step, LOCAL_BATCH * world)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(float(opt.clip_grad_norm_(max_norm)))
        opt.step()
        opt.zero_grad()
    owners = {}
    for u in opt.units:  # which rank updates each whole-tensor parameter
        for seg in u.layout.segments:
            owners[seg.name] = seg.offset // u.layout.shard_numel
    return zeroshard.full_state_dict(model, rank0_only=False), norms, owners


def compare(recipe: str, stage: int, rank: int, world: int, max_norm: float) -> dict:
    ref, ref_norms = reference(recipe, world, max_norm)
    got, norms, owners = zero_run(recipe, stage, rank, world, max_norm)
    rel = max(float((got[n] - t).abs().max() / t.abs().max().clamp_min(1e-12)) for n, t in ref.items())
    moved = max(float((t - llama().state_dict()[n]).abs().max()) for n, t in ref.items())
    return {"rel": rel, "moved": moved, "norms": norms, "ref_norms": ref_norms, "owners": owners}


CASES = [(recipe, stage, MAX_NORM) for recipe in ("muon", "adafactor") for stage in (0, 1, 2, 3)] + [
    ("muon", stage, NO_CLIP) for stage in (2, 3)]


def key(recipe: str, stage: int, max_norm: float) -> str:
    return f"{recipe}-{stage}" + ("" if max_norm == MAX_NORM else "-noclip")


def worker(rank: int, world: int, out: str) -> None:
    results = {key(*case): compare(*case[:2], rank, world, case[2]) for case in CASES}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.barrier()


def run_one_process() -> dict:
    return {key(*case): compare(*case[:2], 0, 1, case[2]) for case in CASES}


if __name__ == "__main__":  # (debugging: python -m tests.whole_tensor_worker)
    print(json.dumps({k: {"rel": v["rel"]} for k, v in run_one_process().items()}, indent=1))


def _train(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        ids = batch(step, LOCAL_BATCH * world)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _built(recipe: str, stage: int) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    model = llama()
    cls = torch.optim.Adafactor if recipe == "adafactor" else torch.optim.AdamW
    kw = {"lr": 1e-2} if recipe == "adafactor" else {"fused_adam": False}
    return model, zeroshard.ZeroOptimizer(groups(model, recipe, zero=True), cls, stage=stage, module=model, **kw)


def _state(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer) -> dict:
    """Weights, and the whole optimizer state by parameter name (consolidated: a collective)."""
    cons = opt.consolidated_state_dict(to_rank=None)
    names = [opt.param_names[id(p)] for g in opt.param_groups for p in g["params"]]  # (the state's index order)
    return {"weights": zeroshard.full_state_dict(model, rank0_only=False),
            "state": {names[i]: s for i, s in cons["state"].items()}}


def resume_worker(rank: int, world: int, out: str, root: str, recipe: str, stage: int) -> None:
    """Trains 3 steps, saves, trains 3 more (the reference); a fresh model and optimizer load
    the checkpoint and train the same 3 steps: equal bit for bit. Writes the loaded state for a
    reshard check at another world size."""
    model, opt = _built(recipe, stage)
    _train(model, opt, range(3), rank, world)
    zeroshard.save_checkpoint(root, 3, model=model, optimizer=opt).wait()
    loaded_state = _state(model, opt)
    _train(model, opt, range(3, 6), rank, world)
    ref = _state(model, opt)
    opt.close()
    model, opt = _built(recipe, stage)
    zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    at_load = _state(model, opt)
    _train(model, opt, range(3, 6), rank, world)
    got = _state(model, opt)
    out_d = {"resume_equal": _equal(ref, got), "load_equal": _equal(loaded_state, at_load),
             "keys": sorted({k for s in got["state"].values() for k in s})}
    if rank == 0:
        torch.save(loaded_state, f"{out}.saved_state.pt")
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(out_d, f)


def reshard_worker(rank: int, world: int, out: str, root: str, recipe: str, stage: int, saved: str) -> None:
    """Loads a checkpoint written at another world size: weights and optimizer state equal."""
    model, opt = _built(recipe, stage)
    zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"equal": _equal(torch.load(saved, weights_only=True), _state(model, opt))}, f)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b
