"""Runs inside each rank: the usual PyTorch training loop, unchanged, on a Hugging Face GPT-2,
with ZeroOptimizer in place of torch.optim.AdamW; against plain torch.optim.AdamW on one
process with the same global batch. Writes per-cell results as JSON for test_dropin.py."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import zeroshard

STEPS = 8
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 64
MAX_NORM = 0.05  # bites on every step (the gradient norm is ~1-5)


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


@dataclass(frozen=True)
class Cell:
    stage: int
    scenario: str

    @property
    def key(self) -> str:
        return f"stage{self.stage}-{self.scenario}"


SCENARIOS = ("loop", "div_loss", "to_device", "grad_scaler", "autocast_bf16", "accumulate", "zero_grad_keep",
             "compile", "state_dict")


def _autocast(scenario: str):
    if scenario == "grad_scaler":
        return torch.autocast("cpu", dtype=torch.float16)
    if scenario == "autocast_bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, scenario: str, rank: int, world: int,
          compiled: bool = False) -> dict:
    """The loop as people write it; only the optimizer differs between the two runs."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scenario == "grad_scaler" else None
    fwd = torch.compile(model) if compiled else model
    per = GLOBAL_BATCH // world
    losses, norms = [], []
    micro = 2 if scenario == "accumulate" else 1
    for step in range(STEPS):
        batch = tokens(step)[rank * per:(rank + 1) * per]
        total = 0.0
        for part in batch.chunk(micro):
            with _autocast(scenario):
                loss = fwd(input_ids=part, labels=part).loss
            if scenario == "div_loss" or micro > 1:
                loss /= micro if micro > 1 else 2  # in place on the model's output
            total += float(loss)
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        if scenario == "zero_grad_keep":
            model.zero_grad(set_to_none=False)
        else:
            model.zero_grad()
        losses.append(_mean_over_ranks(total, world))
        norms.append(float(norm))
        if scenario == "state_dict" and step == 3:
            probes = _touch_state(model)
    out = {"losses": losses, "norms": norms}
    if scenario == "state_dict":
        out["probes"] = probes
    return out


def _touch_state(model: torch.nn.Module) -> dict:
    """Mid-training, what torch code does with a model's parameters and state dict: read a
    parameter, print it, torch.save / torch.load / load_state_dict its own state dict, then
    load a full state dict with other values (the initial weights) and train on from there."""
    import copy
    import io
    w = model.transformer.h[0].mlp.c_fc.weight
    probe = {"read_sum": float(w.sum()), "read_norm": float(w.norm()), "repr": len(repr(w)) > 0}
    buf = io.BytesIO()
    with warnings.catch_warnings(record=True) as seen:  # (pieces of sharded tensors: Note [saving pieces])
        warnings.simplefilter("default")  # (what a user's log shows: each text once)
        torch.save(model.state_dict(), buf)
    warned = [str(w.message) for w in seen if issubclass(w.category, zeroshard.ShardOnlySaveWarning)]
    probe["save_warnings"] = len(warned)
    probe["saved_bytes"] = buf.tell()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # nothing is unpickled but tensors and plain records
    if warned:
        probe["save_warned"] = warned[0]
        try:  # a file of pieces is refused at load, before anything is copied
            model.load_state_dict(loaded)
        except ValueError as exc:
            probe["load_refused"] = str(exc)
        model.load_state_dict(copy.deepcopy(model.state_dict()))  # in memory: pieces load back
    else:
        model.load_state_dict(loaded)
    model.load_state_dict(gpt2().state_dict())
    probe["after_load_sum"] = float(model.transformer.h[0].mlp.c_fc.weight.sum())
    return probe


def _mean_over_ranks(x: float, world: int) -> float:
    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def weights(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return zeroshard.full_state_dict(model, rank0_only=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# The reference depends on the scenario alone (one process, the whole batch, torch.optim.AdamW):
# each rank trains it once per scenario and compares every stage's cell against that run.
_REFERENCES: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}


def reference(scenario: str) -> tuple[dict, dict[str, torch.Tensor]]:
    if scenario not in _REFERENCES:
        torch.manual_seed(0)
        ref = gpt2()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        ref_out = train(ref, ref_opt, scenario, 0, 1, compiled=scenario == "compile")
        _REFERENCES[scenario] = ref_out, {n: p.detach().clone() for n, p in ref.named_parameters()}
    return _REFERENCES[scenario]


def run_cell(cell: Cell, rank: int, world: int) -> dict:
    ref_out, ref_w = reference(cell.scenario)
    torch.manual_seed(0)
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=cell.stage)
    if cell.scenario == "to_device":
        model.to("cpu:0")  # what Trainer / Accelerate do after the optimizer exists
    out = train(model, opt, cell.scenario, rank, world, compiled=cell.scenario == "compile")
    got_w = weights(model, cell.stage)
    init_w = {n: p.detach() for n, p in gpt2().named_parameters()}
    return {
        "loss_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(out["losses"], ref_out["losses"])),
        "norm_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(out["norms"], ref_out["norms"])),
        "weight_diff": max(float((got_w[n].float() - ref_w[n].float()).abs().max()) for n in ref_w),
        "moved": max(float((got_w[n].float() - init_w[n].float()).abs().max()) for n in ref_w),
        "norms": out["norms"][:3], "ref_norms": ref_out["norms"][:3],
        "probes": out.get("probes"), "ref_probes": ref_out.get("probes"),
        "finite": all(math.isfinite(x) for x in out["losses"]),
    }


def worker(rank: int, world: int, out_path: str, cells: list[tuple[int, str]]) -> None:
    results = {}
    for stage, scenario in cells:
        cell = Cell(stage, scenario)
        try:
            results[cell.key] = run_cell(cell, rank, world)
        except Exception as exc:  # reported per cell; the other cells still run
            results[cell.key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if world > 1:
                raise
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def grad_ops_worker(rank: int, world: int, out_path: str, stage: int) -> None:
    """What torch code computes from ``p.grad`` after backward, against the same expressions
    on a single-process reference with the whole batch."""
    import warnings
    ref = gpt2()
    ref(input_ids=tokens(0), labels=tokens(0)).loss.backward()
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    per = GLOBAL_BATCH // world
    part = tokens(0)[rank * per:(rank + 1) * per]
    model(input_ids=part, labels=part).loss.backward()
    exprs = {
        "norm2": lambda g: torch.linalg.vector_norm(g),
        "norm1": lambda g: torch.linalg.vector_norm(g, 1),
        "norminf": lambda g: torch.linalg.vector_norm(g, float("inf")),
        "norm0": lambda g: torch.linalg.vector_norm(g, 0),
        "tensor_norm": lambda g: g.norm(),
        "sum": lambda g: g.sum(),
        "mean": lambda g: g.mean(),
        "absmax": lambda g: g.abs().max(),
        "sq_sum": lambda g: g.pow(2).sum(),
        "finite": lambda g: torch.isfinite(g).all().float(),
        "flip_first": lambda g: g.flatten().flip(0)[0],  # no sharded rule: gathered
    }
    worst: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # Sums cancel: their error is measured against the sum of magnitudes, an element's
            # against the largest magnitude (the scale of the rounding in each).
            scale = {"sum": float(q.grad.abs().sum()), "mean": float(q.grad.abs().mean()),
                     "flip_first": float(q.grad.abs().max())}
            for key, fn in exprs.items():
                a, b = float(fn(p.grad)), float(fn(q.grad))
                worst[key] = max(worst.get(key, 0.0), abs(a - b) / max(abs(b), scale.get(key, 0.0), 1e-30))
        total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        ref_total = float(torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]))
        worst["get_total_norm"] = abs(total - ref_total) / ref_total
        # Replacing and clearing .grad: torch semantics after reconcile.
        p0 = next(model.parameters())
        p0.grad = p0.grad * 2  # a new tensor: its values become the gradient
        doubled = float(torch.linalg.vector_norm(p0.grad))
        opt.clip_grad_norm_(1e9)  # reconciles
        worst["replaced"] = abs(float(torch.linalg.vector_norm(p0.grad)) - doubled) / doubled
        repr(p0.grad)  # never a collective (would hang if one rank did it alone)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"worst": worst, "type": type(p0.grad).__name__}, f)


def scaler_skip_worker(rank: int, world: int, out_path: str, stage: int) -> None:
    """GradScaler with an overflow on one rank only (rank 1's loss is inf at step 1): every
    rank must skip that step and halve the scale, as one process with the whole batch does."""
    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, r: int, w: int) -> float:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        per = GLOBAL_BATCH // w
        for step in range(3):
            part = tokens(step)[r * per:(r + 1) * per]
            loss = model(input_ids=part, labels=part).loss
            if step == 1 and (r == 1 or w == 1):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            model.zero_grad()
        return scaler.get_scale()
    ref = gpt2()
    ref_scale = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 0, 1)
    model = gpt2()
    scale = run(model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage), rank, world)
    got = weights(model, stage)
    diff = max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"scale": scale, "ref_scale": ref_scale, "diff": diff}, f)


def comm_worker(rank: int, world: int, out_path: str, stage: int) -> None:
    """Bytes each collective kind moves in one training step, for the pytest side to check
    against what the stage's design says it must move."""
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    opt.comm_report(reset=True)  # (construction's broadcast of rank 0's values)
    part = tokens(0)[rank * 2:(rank + 1) * 2]
    model(input_ids=part, labels=part).loss.backward()
    opt.step()
    units = [{"padded": u.layout.padded_numel, "elsize": u.flat.element_size(), "root": u is (
        opt.units[opt.engine.gatherer.root] if opt.engine.gatherer is not None and opt.engine.gatherer.root is not None else None)}
        for u in opt.units]
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"report": opt.comm_report(), "units": units}, f)


def hybrid_worker(rank: int, world: int, out_path: str, stage: int, ckpt: str) -> None:
    """A (replicate 2 x shard 2) mesh on 4 ranks: the usual loop against single-process
    torch.optim with the same global batch; the traffic that crosses replicas; a checkpoint
    written under the mesh, resumed under it and at world 1."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    ref = gpt2()
    ref_out = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), "loop", 0, 1)
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage, mesh=mesh)
    opt.comm_report(reset=True)
    out = train(model, opt, "loop", rank, world)
    report = opt.comm_report()
    got = weights(model, stage)
    diff = max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref_out["losses"]))
    shard_bytes = sum((u.owned[1] - u.owned[0]) * 4 if u.policy.shard_gradients else u.layout.padded_numel * 4
                      for u in opt.units)
    zeroshard.save_checkpoint(ckpt, STEPS, model=model, optimizer=opt)
    model2 = gpt2()
    opt2 = zeroshard.ZeroOptimizer(model2, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage, mesh=mesh)
    zeroshard.load_checkpoint(ckpt, model=model2, optimizer=opt2)
    resumed = weights(model2, stage)
    resume_equal = all(torch.equal(resumed[n], got[n]) for n in got)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"diff": diff, "loss_rel": loss_rel, "report": report, "shard_bytes": shard_bytes,
                   "steps": STEPS, "resume_equal": resume_equal,
                   "weights_sum": float(sum(got[n].double().sum() for n, _ in ref.named_parameters()))}, f)


def add_group_worker(rank: int, world: int, out_path: str, stage: int) -> None:
    """Progressive unfreezing: the final layer norm starts frozen and joins as a new param
    group (its own lr) after 3 steps, as with torch.optim.AdamW.add_param_group."""
    def run(model: torch.nn.Module, make: Any, r: int, w: int) -> None:
        ln = model.transformer.ln_f
        ln.requires_grad_(False)
        opt = make([p for p in model.parameters() if p.requires_grad])
        per = GLOBAL_BATCH // w
        for step in range(6):
            if step == 3:
                ln.requires_grad_(True)
                opt.add_param_group({"params": list(ln.parameters()), "lr": 5e-3, "weight_decay": 0.0})
            part = tokens(step)[r * per:(r + 1) * per]
            model(input_ids=part, labels=part).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            model.zero_grad()
    ref = gpt2()
    run(ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 0, 1)
    model = gpt2()
    run(model, lambda ps: zeroshard.ZeroOptimizer(ps, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage,
                                                  **({"module": model} if stage == 3 else {})), rank, world)
    got = weights(model, stage)
    diff = max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"diff": diff}, f)
