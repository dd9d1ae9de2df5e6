"""Runs inside each gloo rank for tests/dist/test_quantized_collectives.py: training with
quantized collectives (Note [quantized collectives]) against full precision, per stage, mesh
and codec, with tiny parameters; the bytes per link per codec; a bitwise resume with error feedback."""
from __future__ import annotations

import json
from typing import Any, Optional

import torch

import zeroshard
from tests.support.dropin_worker import GLOBAL_BATCH, gpt2, tokens, weights
from tests.support.hpz_worker import scope_kwargs


class Tiny(torch.nn.Module):
    """Parameters with fewer elements than ranks (a 1-element bias, a 2-element weight)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _run(kind: str, kwargs: dict, rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = gpt2() if kind == "gpt2" else Tiny()
    if kind == "tiny_frozen":  # a frozen base (Note [frozen units]): gathered through the codec too
        model.a.requires_grad_(False)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, **kwargs)
    per = max(1, GLOBAL_BATCH // world)
    losses, reports = [], {}
    for step in range(steps):
        opt.comm_report(reset=True)
        if kind == "gpt2":
            batch = tokens(step).repeat(2, 1)[rank * per:(rank + 1) * per]
            loss = model(input_ids=batch, labels=batch).loss
        else:
            g = torch.Generator().manual_seed(step * 10 + rank)
            loss = model(torch.randn(4, 3, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        reports = opt.comm_report()
    stage = kwargs.get("stage", 0)
    w = weights(model, stage)
    out = {"losses": losses, "report": reports, "errors": dict(opt.engine.codecs.last_step_error),
           "weights": {n: t.flatten()[:64].tolist() for n, t in w.items()},
           "units": [[u.layout.padded_numel, i == getattr(opt.engine.sharding.gatherer, "root", None)]
                     for i, u in enumerate(opt.units)]}
    opt.close()
    return out


def train_worker(rank: int, world: int, out_path: str, cells: list[tuple[str, str, int, dict, int]],
                 resume: Optional[tuple[str, int, dict]] = None) -> None:
    """Each cell: (name, model, stage/scope spec, codec kwargs, steps); then ``_resume``'s
    run where ``resume`` gives its (checkpoint directory, stage, codec kwargs)."""
    results: dict[str, Any] = {}
    if resume is not None:
        results["resume"] = _resume(rank, world, *resume)
    for name, kind, spec, codec_kwargs, steps in cells:
        scope, stage = spec.split("-")[0], int(spec.split("-")[1])
        kwargs = {**(scope_kwargs(scope, stage) if world == 4 else {"stage": stage}), **codec_kwargs}
        results[name] = _run(kind, kwargs, rank, world, steps)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def _resume(rank: int, world: int, ckpt: str, stage: int, codec_kwargs: dict) -> dict:
    """3 steps, save, 3 more; a fresh optimizer loads the step-3 checkpoint and does the same 3:
    the weights must agree bit for bit (the residuals of error feedback are in the checkpoint)."""
    def fresh() -> tuple[Any, Any]:
        torch.manual_seed(0)
        m = gpt2()
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, stage=stage, **codec_kwargs)

    def steps(m: Any, o: Any, a: int, b: int) -> None:
        per = GLOBAL_BATCH // world
        for s in range(a, b):
            batch = tokens(s)[rank * per:(rank + 1) * per]
            m(input_ids=batch, labels=batch).loss.backward()
            o.step()
            o.zero_grad()
    m1, o1 = fresh()
    steps(m1, o1, 0, 3)
    zeroshard.save_checkpoint(ckpt, 3, model=m1, optimizer=o1)
    residuals = {k: float(v.abs().max()) for k, v in o1.engine.codecs.residuals.items()}
    steps(m1, o1, 3, 6)
    m2, o2 = fresh()
    zeroshard.load_checkpoint(ckpt, model=m2, optimizer=o2)
    steps(m2, o2, 3, 6)
    a, b = weights(m1, stage), weights(m2, stage)
    m3, o3 = fresh()  # the same resume with the residuals dropped: must differ (they matter)
    zeroshard.load_checkpoint(ckpt, model=m3, optimizer=o3)
    o3.engine.codecs.residuals.clear()
    steps(m3, o3, 3, 6)
    c = weights(m3, stage)
    out = {"equal": all(torch.equal(a[n], b[n]) for n in a), "residuals": residuals,
           "differs_without": any(not torch.equal(a[n], c[n]) for n in a),
           "accumulated_error": _accumulated_error(o1.engine.mesh.comm, rank)}
    for o in (o1, o2, o3):
        o.close()
    return out


def _accumulated_error(comm: Any, rank: int, rounds: int = 20) -> dict[str, float]:
    """The same gradient reduced ``rounds`` times through int4, with and without error feedback:
    the sum of the results against ``rounds`` x the exact sum (feedback keeps the accumulated
    error at about one encoding's, without it the error grows with every round)."""
    from zeroshard.comm.codecs import CollectiveCodecs, LinkCodecs
    x = torch.randn(256, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    comm.all_reduce(exact)
    n = x.numel() // comm.world_size
    lo, hi = comm.rank * n, (comm.rank + 1) * n
    out = {}
    for feedback in (False, True):
        codecs = LinkCodecs(CollectiveCodecs(grads="int4", block=32, error_feedback=feedback))
        total = torch.zeros(n)
        for _ in range(rounds):
            full, part = x.clone(), torch.empty(n)
            comm.reduce_for_shard(full, None if comm.result_in_full else part, codecs, "t").wait()
            total += full[lo:hi] if comm.result_in_full else part
        out["with" if feedback else "without"] = float((total - rounds * exact[lo:hi]).abs().max())
    return out
