"""Runs inside each gloo rank for tests/dist/test_quantized_collectives.py: training with
quantized collectives (Note [quantized collectives]) against full precision, per stage, mesh
and codec, with tiny parameters; the bytes per link per codec; a bitwise resume with error feedback."""
from __future__ import annotations

import json
import warnings
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
    """Each cell: (name, model, stage/scope spec, codec kwargs, steps); then, where ``resume``
    gives its (checkpoint directory, stage, codec kwargs), ``_resume``'s runs on the flat mesh
    and on a hybrid one (every replica's residuals), ``_rescaled_residuals`` and ``_skipped_step``."""
    results: dict[str, Any] = {}
    if resume is not None:
        ckpt, stage, codec_kwargs = resume
        results["resume"] = _resume(rank, world, ckpt, {"stage": stage}, codec_kwargs)
        results["rescale"] = _rescaled_residuals(rank, world)
        results["skipped"] = _skipped_step(rank, world)
        if world == 4:
            results["resume_hybrid"] = _resume(rank, world, ckpt + "-hybrid", scope_kwargs("hybrid", stage),
                                               {**codec_kwargs, "codec_links": "all"})
    for name, kind, spec, codec_kwargs, steps in cells:
        scope, stage = spec.split("-")[0], int(spec.split("-")[1])
        kwargs = {**(scope_kwargs(scope, stage) if world == 4 else {"stage": stage}), **codec_kwargs}
        results[name] = _run(kind, kwargs, rank, world, steps)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def _resume(rank: int, world: int, ckpt: str, mesh_kwargs: dict, codec_kwargs: dict) -> dict:
    """3 steps, save, 3 more; a fresh optimizer loads the step-3 checkpoint and does the same 3:
    the weights must agree bit for bit (the residuals of error feedback are in the checkpoint).
    The same resume with the residuals dropped (on a hybrid mesh: those of the replicas after
    the first, which the first replica's files held none of before) must differ."""
    stage = mesh_kwargs["stage"]

    def fresh() -> tuple[Any, Any]:
        torch.manual_seed(0)
        m = gpt2()
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, **mesh_kwargs, **codec_kwargs)

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
    saved = {k: v.clone() for k, v in o1.engine.codecs.residuals.items()}
    steps(m1, o1, 3, 6)
    m2, o2 = fresh()
    zeroshard.load_checkpoint(ckpt, model=m2, optimizer=o2)
    loaded = {k: v.clone() for k, v in o2.engine.codecs.residuals.items()}
    steps(m2, o2, 3, 6)
    a, b = weights(m1, stage), weights(m2, stage)
    m3, o3 = fresh()  # the same resume with the residuals dropped: must differ (they matter)
    zeroshard.load_checkpoint(ckpt, model=m3, optimizer=o3)
    replicas = o3.engine.replicas
    if replicas is None or replicas.rank > 0:
        o3.engine.codecs.residuals.clear()
    steps(m3, o3, 3, 6)
    c = weights(m3, stage)
    out = {"equal": all(torch.equal(a[n], b[n]) for n in a), "residuals": residuals,
           "restored": sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved),
           "differs_without": any(not torch.equal(a[n], c[n]) for n in a)}
    if replicas is None:
        out["accumulated_error"] = _accumulated_error(o1.engine.mesh.comm, rank)
    else:  # (the replicas' residuals differ: a checkpoint of the first replica's alone cannot resume them)
        mine = torch.cat([saved[k] for k in sorted(saved)])
        theirs = [torch.empty_like(mine) for _ in range(replicas.world_size)]
        torch.distributed.all_gather(theirs, mine, group=replicas.group)
        out["replicas_differ"] = not torch.equal(theirs[0], theirs[1])
        m4 = gpt2()  # the hybrid checkpoint on the flat mesh of the same ranks: its residuals do not apply, said so
        o4 = zeroshard.ZeroOptimizer(m4, torch.optim.AdamW, lr=1e-2, stage=stage, **codec_kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeroshard.load_checkpoint(ckpt, model=m4, optimizer=o4)
        out["other_mesh"] = {"warnings": [str(w.message) for w in caught if "residuals" in str(w.message)],
                             "residuals": len(o4.engine.codecs.residuals)}
        o4.close()
    for o in (o1, o2, o3):
        o.close()
    return out


def _rescaled_residuals(rank: int, world: int) -> dict:
    """fp16 with the loss scale doubling after every clean step: the residuals after a step
    that moved the scale are those its reduction left, times new/old (Note [residuals under a
    moving loss scale]); a later step that halves it (an overflow, skipped) leaves those from before
    it, times new/old (Note [residuals of a skipped step])."""
    torch.manual_seed(0)
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, mixed_precision="fp16",
                                  initial_loss_scale=2.0 ** 8, loss_scale_growth_interval=1, grad_codec="int8",
                                  codec_block=32, grad_error_feedback=True, bucket_size_mb=0.02)
    per = GLOBAL_BATCH // world
    checks = []
    last = model.transformer.ln_f.bias  # (an overflow in one unit: the others keep their residuals)
    for s in range(3):
        start = {k: v.clone() for k, v in opt.engine.codecs.residuals.items()}
        batch = tokens(s)[rank * per:(rank + 1) * per]
        hook = last.register_hook(lambda g: g * float("inf")) if s == 2 and rank == 0 else None
        opt.backward(model(input_ids=batch, labels=batch).loss)
        if hook is not None:
            hook.remove()
        opt.engine.grads.finalize()  # (the reductions done: the residuals as this step left them)
        before, old = {k: v.clone() for k, v in opt.engine.codecs.residuals.items()}, opt.loss_scale
        opt.step()
        opt.zero_grad()
        after, new = opt.engine.codecs.residuals, opt.loss_scale
        if s == 2:  # (skipped: what the step's reductions left is dropped with its sums)
            before = start
        checks.append({"old": old, "new": new, "nonzero": sum(int(v.count_nonzero()) for v in after.values()),
                       "rescaled": sorted(after) == sorted(before) and
                       all(torch.equal(after[k], before[k] * (new / old)) for k in before)})
    opt.close()
    return {"checks": checks}


def _skipped_step(rank: int, world: int) -> dict:
    """Note [residuals of a skipped step]: fp16 with int4 gradients and error feedback; step 1
    overflows (inf in one unit's gradient on rank 0) and is skipped. Every residual, the finite
    units' too, must be as before it, and after step 2 the weights and residuals must equal those
    of a run in which step 1 never ran (at the scaler's smallest scale, 1, the skip leaves the
    scale as it was, so the two runs are comparable bit for bit)."""
    def fresh() -> tuple[Any, Any]:
        torch.manual_seed(0)
        m = gpt2()
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, stage=2, mixed_precision="fp16",
                                          initial_loss_scale=1.0, grad_codec="int4", codec_block=32,
                                          grad_error_feedback=True, bucket_size_mb=0.02)
    per = GLOBAL_BATCH // world

    def step(m: Any, o: Any, s: int, overflow: bool = False) -> None:
        batch = tokens(s)[rank * per:(rank + 1) * per]
        last = m.transformer.ln_f.bias
        hook = last.register_hook(lambda g: g * float("inf")) if overflow and rank == 0 else None
        o.backward(m(input_ids=batch, labels=batch).loss)
        if hook is not None:
            hook.remove()
        o.step()
        o.zero_grad()
    m1, o1 = fresh()
    step(m1, o1, 0)
    before = {k: v.clone() for k, v in o1.engine.codecs.residuals.items()}
    step(m1, o1, 1, overflow=True)
    after = {k: v.clone() for k, v in o1.engine.codecs.residuals.items()}
    out = {"skipped": o1.engine.scaler.skipped_steps, "scale": o1.loss_scale,
           "nonzero": sum(int(v.count_nonzero()) for v in before.values()),
           "kept": sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)}
    step(m1, o1, 2)
    m2, o2 = fresh()
    step(m2, o2, 0)
    step(m2, o2, 2)
    a, b = weights(m1, 2), weights(m2, 2)
    ra, rb = o1.engine.codecs.residuals, o2.engine.codecs.residuals
    out["as_if_never"] = (all(torch.equal(a[n], b[n]) for n in a) and sorted(ra) == sorted(rb)
                          and all(torch.equal(ra[k], rb[k]) for k in ra))
    for o in (o1, o2):
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
