"""Spawned cases of tests/dist/test_complex_params.py (issue 39): complex parameters trained by a
ZeroOptimizer against plain torch.optim, at stages 0-3 and CPU offload, on 1 or 2 gloo ranks; the
torch-format state (complex moments); a torch.optim state dict loaded; native checkpoints saved
and loaded at the same world size and resharded (saved at 2 ranks, loaded at 1).

Every rank trains on the same batch, so the data-parallel mean gradient is the reference's
bit for bit (a sum of equal terms halved is exact), and the comparisons can be bitwise. The
results are JSON: per check the largest absolute difference (0.0 = bitwise) or a flag."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import zeroshard


class Mixed(nn.Module):
    """Real and complex parameters of odd sizes: laid out in one unit, the 2-rank slice
    boundary falls inside ``c1`` and ``c2`` follows an odd-sized real (aligned to an even offset)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(7, 3, generator=g))
        self.c1 = nn.Parameter(torch.randn(5, 3, dtype=torch.complex64, generator=g))
        self.b = nn.Parameter(torch.randn(1, generator=g))
        self.c2 = nn.Parameter(torch.randn(9, dtype=torch.complex64, generator=g))
        self.e = nn.Parameter(torch.randn(5, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.w @ x)                          # (7, n) real
        z = self.c1 @ h[:3].to(torch.complex64)             # (5, n) complex
        z = z * self.c2[:5, None] + self.c2[5:].sum()
        out = z.real.pow(2).mean() + z.imag.abs().mean() + (self.b * h[3:].mean()).sum()
        return out + (self.e * h[:5].mean(1)).sum() ** 2


def batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + step))


# (name, torch class, its options, ZeroOptimizer options, bitwise against torch)
OPTIMIZERS: list[tuple[str, type, dict, dict, bool]] = [
    ("adam", torch.optim.Adam, {"lr": 1e-2}, {"fused_adam": False}, True),
    # the fused kernel rounds differently from torch's Adam for real parameters as well (~1 ulp)
    ("adamw_fused", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {}, False),
    # torch's SGD does complex arithmetic (not view_as_real): its fused multiply-adds round apart
    ("sgd_momentum", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, {}, False),
]
CASES = [(stage, name, None) for stage in (0, 1, 2, 3) for name, *_ in OPTIMIZERS] + \
        [(stage, "adam", "cpu") for stage in (1, 2, 3)] + \
        [(stage, "adamw_fused", "nvme") for stage in (2, 3)]  # (NVMe streams the fused kernel's state)


def case_key(stage: int, name: str, offload: Optional[str]) -> str:
    return f"stage{stage}-{name}" + (f"-offload_{offload}" if offload else "")


def _weights(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """The full parameters (a collective at stage 3)."""
    full = zeroshard.full_state_dict(model, rank0_only=False) if opt.engine.shards_parameters else model.state_dict()
    return {k: v.detach().clone() for k, v in full.items()}


def _diff(got: dict, want: dict) -> dict:
    """Per key: the largest absolute difference, or a string naming a key, shape or dtype that differs."""
    out: dict[str, Any] = {}
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, dict):
            out[str(k)] = _diff(g if isinstance(g, dict) else {}, w)
        elif not isinstance(g, torch.Tensor):
            out[str(k)] = f"missing (got {type(g).__name__})"
        elif g.dtype != w.dtype or g.shape != w.shape:
            out[str(k)] = f"got {g.dtype}{tuple(g.shape)}, torch has {w.dtype}{tuple(w.shape)}"
        else:
            out[str(k)] = float((g - w).abs().max()) if w.numel() else 0.0
    return out


def _boundary_in_complex(opt: Any, world: int) -> bool:
    """Whether some rank's slice starts inside a complex parameter's segment."""
    for u in opt.engine.units:
        starts = [u.layout.slice_of(r)[0] for r in range(1, world)]
        if any(s.complex_dtype is not None and s.offset < b < s.end for s in u.layout.segments for b in starts):
            return True
    return False


def _train(model: nn.Module, opt: Any, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()


def parity(stage: int, name: str, offload: Optional[str], world: int, directory: str) -> dict:
    _, cls, kw, zkw, bitwise = next(o for o in OPTIMIZERS if o[0] == name)
    model, ref = Mixed(), Mixed()
    if offload == "nvme":
        zkw = {**zkw, "nvme_path": os.path.join(directory, "nvme")}
        os.makedirs(zkw["nvme_path"], exist_ok=True)
    opt = zeroshard.ZeroOptimizer(model, cls, stage=stage, offload_optimizer=offload, **zkw, **kw)
    ropt = cls(ref.parameters(), **kw)
    _train(model, opt, range(3))
    _train(ref, ropt, range(3))
    got = opt.consolidated_state_dict(to_rank=None)
    out = {"bitwise": bitwise, "boundary_in_complex": _boundary_in_complex(opt, world),
           "weights": _diff(_weights(model, opt), ref.state_dict()),
           "state": _diff(got["state"], ropt.state_dict()["state"]),
           "view": _diff({n: opt.state[p] for n, p in model.named_parameters()} if stage == 0 else {},
                         {n: ropt.state[p] for n, p in ref.named_parameters()} if stage == 0 else {})}
    opt.close()
    return out


def load_torch_state(stage: int) -> dict:
    """A torch.optim.Adam state dict with complex moments loaded into a ZeroOptimizer, then
    one more step on each: the same parameters and moments."""
    model, ref = Mixed(), Mixed()
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _train(ref, ropt, range(2))
    model.load_state_dict(ref.state_dict())
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
    opt.load_state_dict(ropt.state_dict())
    _train(model, opt, range(2, 3))
    _train(ref, ropt, range(2, 3))
    out = {"weights": _diff(_weights(model, opt), ref.state_dict()),
           "state": _diff(opt.consolidated_state_dict(to_rank=None)["state"], ropt.state_dict()["state"])}
    opt.close()
    return out


def sharded_round_trip(stage: int) -> dict:
    """``state_dict()`` (this rank's real pieces) loaded into a fresh optimizer: the same state."""
    model = Mixed()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    want = opt.consolidated_state_dict(to_rank=None)["state"]
    opt.close()
    opt2 = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
    opt2.load_state_dict(sd)
    out = _diff(opt2.consolidated_state_dict(to_rank=None)["state"], want)
    opt2.close()
    return out


def _snapshot(model: nn.Module, opt: Any) -> dict:
    return {"weights": _weights(model, opt), "state": opt.consolidated_state_dict(to_rank=None)["state"]}


def checkpoint_round_trip(stage: int, directory: str, rank: int) -> tuple[dict, dict]:
    """Saved after 2 steps and loaded into a fresh model and optimizer: the same weights and
    state, bit for bit. Returns (the comparison, the saved snapshot)."""
    root = os.path.join(directory, f"ckpt-stage{stage}")
    model = Mixed()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
    _train(model, opt, range(2))
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)
    saved = _snapshot(model, opt)
    opt.close()
    model2 = Mixed()
    opt2 = zeroshard.ZeroOptimizer(model2, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
    zeroshard.load_checkpoint(root, model=model2, optimizer=opt2)
    back = _snapshot(model2, opt2)
    opt2.close()
    return {"weights": _diff(back["weights"], saved["weights"]), "state": _diff(back["state"], saved["state"])}, saved


def run(rank: int, world: int, out_path: str, resharded_from: Optional[str] = None) -> None:
    import json
    directory = os.path.dirname(out_path)
    results: dict[str, Any] = {}
    for stage, name, offload in CASES:
        results[case_key(stage, name, offload)] = parity(stage, name, offload, world, directory)
    results["load_torch_state"] = {f"stage{s}": load_torch_state(s) for s in (1, 3)}
    results["sharded_state"] = {f"stage{s}": sharded_round_trip(s) for s in (1, 2)}
    results["checkpoint"] = {}
    for stage in (2, 3):
        results["checkpoint"][f"stage{stage}"], saved = checkpoint_round_trip(stage, directory, rank)
        if rank == 0:  # (what a load at another world size must reproduce)
            torch.save(saved, os.path.join(directory, f"saved-stage{stage}.pt"))
    if resharded_from is not None:  # saved at 2 ranks, loaded here (1 rank)
        results["resharded"] = {}
        for stage in (2, 3):
            want = torch.load(os.path.join(resharded_from, f"saved-stage{stage}.pt"))
            model = Mixed()
            opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=1e-2, fused_adam=False)
            info = zeroshard.load_checkpoint(os.path.join(resharded_from, f"ckpt-stage{stage}"), model=model,
                                             optimizer=opt)
            back = _snapshot(model, opt)
            opt.close()
            results["resharded"][f"stage{stage}"] = {
                "weights": _diff(back["weights"], want["weights"]), "state": _diff(back["state"], want["state"]),
                "step": int(info["step"]) if isinstance(info, dict) and "step" in info else None}
    if dist.is_initialized():
        dist.barrier()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)
