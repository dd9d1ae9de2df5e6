"""Runs inside each rank: a Hugging Face Llama whose linear layers are parallelised with torch's
``parallelize_module`` on the "tp" dimension of a ("dp", "tp") mesh, trained by ZeroOptimizer
sharding over "dp" (Note [tensor-parallel parameters]); against single-process
torch.optim.AdamW on the same global batch. Checkpoints written at dp x tp are loaded at
other layouts. Writes per-rank results as JSON (and full states as .pt) for test_tensor_parallel.py."""
from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist

import zeroshard

STEPS = 8
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 128
MAX_NORM = 0.5
LR, WD = 1e-3, 0.1


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def parallelize(model: torch.nn.Module, tp_mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}"
        plan.update({f"{pre}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{pre}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def train(model: torch.nn.Module, opt: Any, dp_rank: int, dp_size: int, steps: int = STEPS,
          clip: Optional[Any] = None) -> list[float]:
    per = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(steps):
        batch = tokens(step)[dp_rank * per:(dp_rank + 1) * per]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        (clip or (lambda: opt.clip_grad_norm_(MAX_NORM)))()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from zeroshard.comm.tensor_parallel import is_dtensor
    from zeroshard.optim.registry import optimizer_for
    if optimizer_for(model) is not None:  # global tensors at every stage
        full = zeroshard.full_state_dict(model, rank0_only=False)
        return {n: full[n] for n, _ in model.named_parameters()}
    return {n: (p.detach().full_tensor() if is_dtensor(p) else p.detach()).clone() for n, p in model.named_parameters()}


def full_state(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of every parameter, global tensors (collectives)."""
    out = {f"w:{n}": t for n, t in full_weights(model).items()}
    sd = opt.consolidated_state_dict(to_rank=None)
    names = [n for g in opt.param_groups for n in [opt.engine.param_names[id(p)] for p in g["params"]]]
    for i, n in enumerate(names):
        for k in ("exp_avg", "exp_avg_sq"):
            if k in sd["state"].get(i, {}):
                out[f"{k}:{n}"] = sd["state"][i][k].clone()
    return out


def reference() -> tuple[torch.nn.Module, list[float]]:
    ref = llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    losses = train(ref, opt, 0, 1, clip=lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    return ref, losses


def tp_mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def parity_worker(rank: int, world: int, out_path: str, stage: int, ckpt: Optional[str]) -> None:
    """dp 2 x tp 2: the loop against single-process AdamW; then (if ``ckpt``) a checkpoint and
    this layout's full state, for the loads at other layouts to compare with."""
    mesh = tp_mesh(2, 2)
    ref, ref_losses = reference()
    model = parallelize(llama(), mesh["tp"])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage, mesh=mesh)
    opt.comm_report(reset=True)
    losses = train(model, opt, mesh.get_local_rank("dp"), 2)
    report = opt.comm_report()
    got = full_weights(model)
    diff = max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    mean = torch.tensor(losses, dtype=torch.float64)  # the global batch's loss: the dp ranks' mean
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    loss_diff = max(abs(a / 2 - b) / b for a, b in zip(mean.tolist(), ref_losses))
    out = {"diff": diff, "loss_diff": loss_diff, "report": report,
           "dtensors": sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")}
    if ckpt is not None:
        zeroshard.save_checkpoint(ckpt, STEPS, model=model, optimizer=opt)
        state = full_state(model, opt)
        out["vs_reference"] = max(float((state[f"w:{n}"] - p.detach()).abs().max()) for n, p in ref.named_parameters())
        if rank == 0:
            torch.save(state, f"{ckpt}.source.pt")
        # resumed at the same layout: equal to the state it was saved from
        model2 = parallelize(llama(), mesh["tp"])
        opt2 = zeroshard.ZeroOptimizer(model2, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage, mesh=mesh)
        zeroshard.load_checkpoint(ckpt, model=model2, optimizer=opt2)
        out["same_layout"] = compare(full_state(model2, opt2), state)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over every weight and moment (inf when keys differ)."""
    if set(got) != set(want):
        return float("inf")
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def load_worker(rank: int, world: int, out_path: str, layout: str, stage: int, ckpt: str) -> None:
    """Loads the dp 2 x tp 2 checkpoint at ``layout`` ("dp4": plain data parallel over 4 ranks,
    "hybrid": a (replicate 2, shard 2) mesh, "dp1": one process, "tp4": dp 1 x tp 4,
    "dp2tp2": the writing layout) at ``stage`` and compares its full state with the source's."""
    model = llama()
    kwargs: dict[str, Any] = {}
    if layout == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    elif layout == "tp4":  # other chunks of the same tensors (loaded, not run: 8-row chunks split heads)
        kwargs["mesh"] = tp_mesh(1, 4)
        model = parallelize(model, kwargs["mesh"]["tp"])
    elif layout == "dp2tp2":  # the writing layout at the other stage: other owned ranges
        kwargs["mesh"] = tp_mesh(2, 2)
        model = parallelize(model, kwargs["mesh"]["tp"])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage, **kwargs)
    info = zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    diff = compare(full_state(model, opt), torch.load(f"{ckpt}.source.pt", weights_only=True))
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"diff": diff, "resharded": info["resharded"]}, f)


def refusals_worker(rank: int, world: int, out_path: str) -> None:
    """What ZeroOptimizer refuses with DTensor parameters, each as one clear error."""
    mesh = tp_mesh(1, 2)
    cases = {"bf16": dict(stage=2, mesh=mesh, mixed_precision="bf16"),
             "no_dp_group": dict(stage=2), "dp_submesh": dict(stage=2, mesh=mesh["dp"]),
             "dp_group": dict(stage=2, process_group=mesh["dp"].get_group())}
    out = {}
    for name, kwargs in cases.items():
        model = parallelize(llama(), mesh["tp"])
        try:
            zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, **kwargs)
            out[name] = "accepted"
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def grads_worker(rank: int, world: int, out_path: str, stage: int) -> None:
    """After backward ``p.grad`` of a DTensor parameter is a DTensor over zeroshard's averaged
    gradient: torch's norm of it is the reference's, and scaling it in place reaches the store."""
    mesh = tp_mesh(2, 2)
    ref = llama()
    batch = tokens(0)
    ref(input_ids=batch, labels=batch).loss.backward()
    model = parallelize(llama(), mesh["tp"])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=stage, mesh=mesh)
    d = mesh.get_local_rank("dp")
    model(input_ids=batch[2 * d:2 * d + 2], labels=batch[2 * d:2 * d + 2]).loss.backward()
    p = model.model.layers[0].self_attn.o_proj.weight
    norm = torch.linalg.vector_norm(p.grad)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    before = float(opt.clip_grad_norm_(1e9))
    for q in model.parameters():
        q.grad.mul_(0.5)
    after = float(opt.clip_grad_norm_(1e9))
    want = float(torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]))
    held = full_weights(model)
    opt.close()  # the model keeps working without the optimizer: its DTensors hold their own shards
    closed = full_weights(model)
    closed_equal = all(torch.equal(closed[n], held[n]) for n in held)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"kind": type(p.grad).__name__, "norm": norm, "before": before, "after": after, "want": want,
                   "closed_equal": closed_equal,
                   "want_param": float(ref.model.layers[0].self_attn.o_proj.weight.grad.norm())}, f)


def small_mlp(tp_mesh_: Any = None) -> torch.nn.Module:
    """Two bias-free linears (colwise then rowwise under tp): a stage-3 unit per layer, so a
    plain-dp rank's one run per parameter (Note [one run per parameter]) lies inside one saved
    tp chunk of the rowwise weight, whose stored order is not the global one (Note [stored order])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 8, bias=False))
    if tp_mesh_ is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        model = parallelize_module(model, tp_mesh_, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def named_moments(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter's global weight and optimizer state tensors, keyed "key:name"."""
    out = {f"w:{n}": t for n, t in full_weights(model).items()}
    sd = opt.consolidated_state_dict(to_rank=None)
    names = [opt.engine.param_names[id(p)] for g in opt.param_groups for p in g["params"]]
    for i, n in enumerate(names):
        for k, v in sd["state"].get(i, {}).items():
            out[f"{k}:{n}"] = torch.as_tensor(v).clone()
    return out


def small_tp_save_worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    """dp 1 x tp 2 at stage 3: 3 AdamW steps, a checkpoint, and the full state it holds."""
    mesh = tp_mesh(1, 2)
    model = small_mlp(mesh["tp"])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=3, mesh=mesh)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    zeroshard.save_checkpoint(ckpt, 3, model=model, optimizer=opt)
    state = named_moments(model, opt)
    if rank == 0:
        torch.save(state, f"{ckpt}.source.pt")
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"saved": sorted(state)}, f)


def small_dp_load_worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    """Loads the dp 1 x tp 2 checkpoint at plain dp ``world`` (no tp), stage 3; writes its full state."""
    model = small_mlp()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=3)
    info = zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    state = named_moments(model, opt)
    if rank == 0:
        torch.save(state, f"{out_path}.loaded.pt")
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"resharded": info["resharded"],
                   "runs": [[r.a, r.b] for r in opt.engine.joined().runs]}, f)
