"""Runs inside each rank: a Hugging Face Llama split into 2 pipeline stages driven by torch's
``torch.distributed.pipelining`` schedules on a ("pp", "dp") mesh, each stage trained by a
ZeroOptimizer sharding over "dp" (Note [pipeline parallelism]); against single-process
torch.optim.AdamW on the same global batch. One spawn runs every case (parity per stage and
schedule, reduction bytes, memory, a SIGTERM-agreed save and bitwise resume, a reshard to
pp 1 x dp 4) and writes per-rank results as JSON for test_pipeline.py."""
from __future__ import annotations

import json
import os
import signal
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import zeroshard

STEPS = 8
GLOBAL_BATCH = 8
SEQ = 8
VOCAB = 64
LAYERS = 4
MICRO = 4
MAX_NORM = 0.05
LR, WD = 1e-3, 0.1


def llama(dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, attention_dropout=dropout)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class StageModule(nn.Module):
    """Layers ``lo:hi`` of a Llama (with the embedding on the first stage, the norm and head on
    the last), under the full model's parameter names: checkpoints key pieces by them."""

    def __init__(self, full: nn.Module, lo: int, hi: int) -> None:
        super().__init__()
        self.config = full.config  # (checkpoints record it: export_hf writes config.json)
        self.model = nn.Module()
        self.first, self.last = lo == 0, hi == LAYERS
        if self.first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in range(lo, hi)})
        self.model.rotary_emb = full.model.rotary_emb
        if self.last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
        pe = self.model.rotary_emb(h, pos)
        for layer in self.model.layers.values():
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.model.norm(h)) if self.last else h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ),
                                                                                       generator=g)


def reference(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, torch.optim.AdamW on the global batch; weights and norms."""
    model = StageModule(llama(), 0, LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        loss_fn(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def parallelize(module: StageModule, tp_mesh: Any) -> None:
    """Megatron-style tensor parallelism of the stage's layers over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan: dict[str, Any] = {}
    for i in module.model.layers:
        pre = f"model.layers.{i}"
        plan.update({f"{pre}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{pre}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(module, tp_mesh, plan)


def tp_case(ref: dict[str, torch.Tensor]) -> dict:
    """pp 2 x dp 1 x tp 2 at stage 2 with 1F1B: the same parity (8 ranks do not fit 2 cores)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    t = Trainer(mesh, 2, "1f1b")
    t.opt.comm_report(reset=True)
    for step in range(STEPS):
        t.step(step)
    report = t.opt.comm_report()
    got = t.weights()
    out = {"rel": max_rel(got, ref), "abs": max(float((got[n] - ref[n]).abs().max()) for n in got),
           "rel_norm": max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in got),
           "dtensors": sum(1 for p in t.module.parameters() if hasattr(p, "full_tensor")),
           "kinds": sorted(report)}
    t.close()
    return out


class Trainer:
    """One rank's stage of a pp x dp run: the stage module, its ZeroOptimizer and a schedule."""

    def __init__(self, mesh: Any, stage: int, schedule: str, zero_stage_class: bool = True, dropout: float = 0.0,
                 **options: Any) -> None:
        from torch.distributed.pipelining import PipelineStage as TorchStage, Schedule1F1B, ScheduleGPipe

        from zeroshard.comm.pipeline import PipelineStage
        self.mesh = mesh
        pp, self.pp_rank = mesh["pp"].size(), mesh.get_local_rank("pp")
        self.dp, self.dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
        per = LAYERS // pp
        self.module = StageModule(llama(dropout), self.pp_rank * per, (self.pp_rank + 1) * per)
        if "tp" in mesh.mesh_dim_names:
            parallelize(self.module, mesh["tp"])
        self.opt = zeroshard.ZeroOptimizer(self.module, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage,
                                           mesh=mesh, **options)
        scaled = (lambda out, y: self.opt.scale_loss(loss_fn(out, y))) if options.get("mixed_precision") else loss_fn
        cls = PipelineStage if zero_stage_class else TorchStage
        pstage = cls(self.module, self.pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pstage, n_microbatches=MICRO,
                                                                                 loss_fn=scaled)
        self.norms: list[float] = []

    def step(self, step: int) -> None:
        x, y = batch(step)
        per = GLOBAL_BATCH // self.dp
        x, y = x[self.dp_rank * per:(self.dp_rank + 1) * per], y[self.dp_rank * per:(self.dp_rank + 1) * per]
        if self.module.first:
            self.schedule.step(x)
        elif self.module.last:
            self.schedule.step(target=y)
        else:
            self.schedule.step()
        self.norms.append(float(self.opt.clip_grad_norm_(MAX_NORM)))
        self.opt.step()
        self.opt.zero_grad()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                for n, p in self.module.named_parameters()}

    def close(self) -> None:
        self.opt.close()


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest |got - want| relative to the largest |want| of each tensor, over ``got``'s names."""
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in got)


def full_state(t: Trainer) -> dict[str, torch.Tensor]:
    """This stage's weights and Adam moments, whole, by the full model's names (a collective over dp)."""
    out = {f"w:{n}": w for n, w in t.weights().items()}
    sd = t.opt.consolidated_state_dict(to_rank=None)
    names = [t.opt.engine.param_names[id(p)] for g in t.opt.param_groups for p in g["params"]]
    for i, n in enumerate(names):
        for k in ("exp_avg", "exp_avg_sq"):
            if k in sd["state"].get(i, {}):
                out[f"{k}:{n}"] = sd["state"][i][k].clone()
    return out


def dp_bytes(report: dict[str, dict]) -> tuple[int, int]:
    """(calls, bytes) of the gradient reductions over dp in a comm_report."""
    grads = {k: v for k, v in report.items() if k in ("reduce_scatter", "all_reduce")}
    return sum(v["calls"] for v in grads.values()), sum(v["bytes"] for v in grads.values())


CASES = [(stage, schedule, {}) for stage in (1, 2) for schedule in ("gpipe", "1f1b")]
# (small buckets: several units per stage, each launched once the last micro-batch delivered it)
CASES += [(stage, "1f1b", {"bucket_size_mb": 0.02}) for stage in (1, 2)]


def watch_launches(reducer: Any) -> list[list]:
    """[backward pass, launched by the end-of-backward flush] of every unit reduction: a unit
    launched from a gradient hook is reduced while the rest of that backward still runs."""
    out: list[list] = []
    flushing = [False]
    flush = reducer.flush

    def watched() -> None:
        flushing[0] = True
        try:
            flush()
        finally:
            flushing[0] = False
    reducer.flush = watched
    reducer.on_launch.append(lambda ui: out.append([reducer.passes, flushing[0]]))
    return out


def parity_cases(mesh: Any, ref: dict[str, torch.Tensor], ref_norms: list[float]) -> dict[str, dict]:
    out = {}
    for stage, schedule, options in CASES:
        t = Trainer(mesh, stage, schedule, **options)
        launches = watch_launches(t.opt.engine.reducer)
        t.opt.comm_report(reset=True)
        for step in range(STEPS):
            t.step(step)
        report = t.opt.comm_report()
        calls, nbytes = dp_bytes(report)
        unit_bytes = sum(u.layout.padded_numel * u.flat.element_size() for u in t.opt.units)
        mem = t.opt.memory_report()
        numel = sum(p.numel() for p in t.module.parameters())
        formula = zeroshard.zero_formula(stage, numel, t.dp)
        out[f"stage{stage}-{schedule}" + ("-buckets" if options else "")] = {
            "rel": max_rel(t.weights(), ref), "norms": t.norms, "ref_norms": ref_norms,
            "calls": calls, "bytes": nbytes, "units": len(t.opt.units), "unit_bytes": unit_bytes,
            "pp_report": {k: v for k, v in report.items() if k.endswith("@pp")},
            "model_states": mem.model_states, "formula": formula.model_states, "launches": launches}
        if stage == 2 and schedule == "1f1b" and not options:
            torch.save(full_state(t), f"{OUT}.uninterrupted.rank{dist.get_rank()}.pt")
        t.close()
    return out


def per_micro_batch_case(mesh: Any) -> dict:
    """torch's own PipelineStage: still correct, but one reduction per micro-batch."""
    t = Trainer(mesh, 2, "1f1b", zero_stage_class=False)
    t.opt.comm_report(reset=True)
    t.step(0)
    calls, nbytes = dp_bytes(t.opt.comm_report())
    t.close()
    return {"calls": calls, "bytes": nbytes}


def preempt_case(mesh: Any, ckpt: str) -> dict:
    """Stage 2, 1F1B: SIGTERM reaches rank 3 alone during step 3; at the step boundary every rank
    agrees to save, then a fresh run loads at pp 2 x dp 2 and finishes the 8 steps."""
    from zeroshard.train import PreemptionHandler
    t = Trainer(mesh, 2, "1f1b")
    saved_at: Optional[int] = None
    with PreemptionHandler() as handler:
        for step in range(STEPS):
            if step == 3 and dist.get_rank() == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            t.step(step)
            stop, _ = handler.agree(None)
            if stop:
                zeroshard.save_checkpoint(ckpt, step + 1, model=t.module, optimizer=t.opt)
                saved_at = step + 1
                break
    saved = full_state(t)
    t.close()
    t = Trainer(mesh, 2, "1f1b")
    info = zeroshard.load_checkpoint(ckpt, model=t.module, optimizer=t.opt)
    same = full_state(t)
    loaded_equal = set(same) == set(saved) and all(torch.equal(same[k], saved[k]) for k in saved)
    for step in range(info["step"], STEPS):
        t.step(step)
    final = full_state(t)
    want = torch.load(f"{OUT}.uninterrupted.rank{dist.get_rank()}.pt", weights_only=True)
    bitwise = set(final) == set(want) and all(torch.equal(final[k], want[k]) for k in want)
    t.close()
    # the whole model's state (every stage's), for the loads at other layouts to compare with
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, saved)
    if dist.get_rank() == 0:
        torch.save({k: v for p in parts for k, v in p.items()}, f"{ckpt}.source.pt")
    dist.barrier()
    return {"saved_at": saved_at, "loaded_equal": loaded_equal, "bitwise": bitwise, "step": info["step"]}


def reshard_case(ckpt: str) -> dict:
    """The pp 2 x dp 2 checkpoint loaded at pp 1 x dp 4: weights and moments equal the source's."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp"))
    t = Trainer(mesh, 2, "1f1b")
    info = zeroshard.load_checkpoint(ckpt, model=t.module, optimizer=t.opt)
    got = full_state(t)
    want = torch.load(f"{ckpt}.source.pt", weights_only=True)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want) if set(got) == set(want) else float("inf")
    t.close()
    return {"diff": diff, "resharded": info["resharded"]}


def fp16_case(mesh: Any) -> dict:
    """fp16 at stage 2: an inf in one first-stage gradient at step 1 (rank 0 only) skips that
    step on every rank of both stages, and every stage's loss scale moves alike."""
    t = Trainer(mesh, 2, "1f1b", mixed_precision="fp16", initial_loss_scale=2.0 ** 8)
    scales: list[float] = []
    before: dict[str, torch.Tensor] = {}
    unchanged = False
    for step in range(4):
        handle = None
        if step == 1 and dist.get_rank() == 0:
            p = next(iter(t.module.parameters()))
            handle = p.register_hook(lambda g: g * float("inf"))
        if step == 1:
            before = t.weights()
        t.step(step)
        if step == 1:
            unchanged = all(torch.equal(v, t.weights()[k]) for k, v in before.items())
        if handle is not None:
            handle.remove()
        scales.append(t.opt.loss_scale)
    t.close()
    return {"scales": scales, "unchanged": unchanged}


def refusals(mesh: Any) -> dict[str, str]:
    """What does not compose with pp, each refused at construction with its reason."""
    out = {}
    planned = dict(stage=2, mesh=mesh, offload="auto", memory_budget="1GB",
                   offload_activations=zeroshard.PlannedActivations(micro_batch=1, seq_len=SEQ))
    for name, kwargs in {"stage3": dict(stage=3, mesh=mesh), "planned_activations": planned}.items():
        module = StageModule(llama(), 0, LAYERS // 2)
        try:
            zeroshard.ZeroOptimizer(module, torch.optim.AdamW, lr=LR, **kwargs).close()
            out[name] = "accepted"
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    from zeroshard.comm.pipeline import PipelineStage
    pp, group = mesh["pp"], mesh["pp"].get_group()
    for name, stages, kind in (("interleaved", 2 * pp.size(), "full"), ("zero_bubble", pp.size(), "input")):
        module = StageModule(llama(), 0, LAYERS // 2)
        opt = zeroshard.ZeroOptimizer(module, torch.optim.AdamW, lr=LR, stage=2, mesh=mesh)
        try:  # (several stages per rank: refused as the stage is built)
            stage = PipelineStage(module, pp.get_local_rank(), stages, torch.device("cpu"), group=group)
            stage.backward_maybe_with_nosync(kind, {}, last_backward=False)
            out[name] = "accepted"
        except (RuntimeError, ValueError) as exc:
            out[name] = str(exc)
        opt.close()
    return out


def load_worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    """2 ranks: the pp 2 x dp 2 checkpoint loaded at pp 1 x dp 2 (then saved again from there,
    for the one-process load of test_pipeline.py) and at pp 2 x dp 1; each rank's weights and
    moments against the source's."""
    from torch.distributed.device_mesh import init_device_mesh
    want = torch.load(f"{ckpt}.source.pt", weights_only=True)
    out = {}
    for layout, shape in (("pp1dp2", (1, 2)), ("pp2dp1", (2, 1))):
        t = Trainer(init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp")), 2, "1f1b")
        info = zeroshard.load_checkpoint(ckpt, model=t.module, optimizer=t.opt)
        got = full_state(t)
        equal = set(got) <= set(want) and all(torch.equal(got[k], want[k]) for k in got)
        out[layout] = {"equal": equal, "keys": len(got), "resharded": info["resharded"]}
        if layout == "pp1dp2":
            zeroshard.save_checkpoint(f"{ckpt}-pp1dp2", info["step"], model=t.module, optimizer=t.opt)
        t.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def activation_offload_case(mesh: Any, directory: str) -> dict[str, dict]:
    """Each stage's decoder layers offloaded (all saved tensors: ``min_bytes=0``) to host memory
    under GPipe and to NVMe files under 1F1B, attention dropout on: several micro-batches are
    between their forward and backward at once, each with its own records (Note [activation
    offload under pipeline schedules]); weights and Adam moments after a few steps against the
    same schedule without offload, bit for bit."""
    steps, out = 2, {}
    for where, schedule in (("cpu", "gpipe"), ("nvme", "1f1b")):
        states = []
        for offload in (None, where):
            options: dict[str, Any] = {}
            if offload is not None:  # (one directory for every rank: each rank's files apart)
                options = {"offload_activations": zeroshard.ActivationOffload(where=offload, min_bytes=0),
                           **({"nvme_path": directory} if offload == "nvme" else {})}
            t = Trainer(mesh, 2, schedule, dropout=0.1, **options)
            for step in range(steps):
                t.step(step)
            states.append(full_state(t))
            if offload is not None:
                acts = t.opt.engine.activations
                report = acts.report()
                got = {"moved": acts.blocks_moved, "bytes_out": report["bytes_out_last_step"],
                       "bytes_in": report["bytes_in_last_step"], "blocks": report["blocks"], "steps": steps,
                       "files_left": sorted(os.listdir(acts.directory)) if acts.directory else []}
            t.close()
        got["bitwise"] = set(states[0]) == set(states[1]) and all(torch.equal(states[0][k], states[1][k])
                                                                  for k in states[0])
        out[f"{where}-{schedule}"] = got
    return out


OUT = ""


def worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    global OUT
    OUT = out_path
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ref, ref_norms = reference()
    out: dict[str, Any] = {"parity": parity_cases(mesh, ref, ref_norms)}
    out["per_micro_batch"] = per_micro_batch_case(mesh)
    out["preempt"] = preempt_case(mesh, ckpt)
    out["reshard"] = reshard_case(ckpt)
    out["refused"] = refusals(mesh)
    out["tp"] = tp_case(ref)
    out["fp16"] = fp16_case(mesh)
    out["activations"] = activation_offload_case(mesh, f"{ckpt}-activations")
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
