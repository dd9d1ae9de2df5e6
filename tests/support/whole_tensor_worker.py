"""Whole-tensor optimizers (torch.optim.Muon with AdamW, Adafactor) under ZeroOptimizer against
the same torch classes in one process on the same global batch (tests/dist/test_whole_tensor.py)."""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional

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


def exact_clip(params: list[torch.Tensor], max_norm: float) -> float:
    """Clipping by the norm summed in float64, as ZeroOptimizer sums its shards' (grads/norm.py),
    then a float32 as torch's: the coefficient is the same float32 whatever the order of the sum. torch's
    ``clip_grad_norm_`` sums per-tensor float32 norms, whose last bit no sharded sum reproduces,
    and Muon's bf16 Newton-Schulz turns a last-bit difference into flipped roundings (the
    ``torch`` clip cases measure that)."""
    total = torch.stack([(p.grad.double() ** 2).sum() for p in params]).sum().sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return float(total)


def weight(rank: int, world: int, exact_sum: bool) -> float:
    """A rank's loss weight: 0 for ranks 2-3 of 4 under ``exact_sum``, whose gradients are then
    zeros, so the sum of the 4 ranks' gradients is exact in any order (gloo's ring sums each
    chunk in its own order, and Muon's bf16 Newton-Schulz turns a last-bit difference into
    flipped roundings: Note [whole-tensor parity] in tests/dist/test_whole_tensor.py)."""
    return 0.0 if exact_sum and rank >= 2 else 1.0


def reference(recipe: str, world: int, max_norm: float, clip: str = "exact", precision: Optional[str] = None,
              exact_sum: bool = False, accumulation: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, torch's own classes, the global batch. Under bf16 the same recipe as
    ZeroOptimizer's: a bf16 model, fp32 master copies that torch's classes update."""
    model = llama()
    named = dict(model.named_parameters())
    masters = {n: p.detach().clone().requires_grad_() for n, p in named.items()}
    if precision == "bf16":  # (parameters only, as ZeroOptimizer casts them: buffers such as RoPE's stay fp32)
        for p in named.values():
            p.data = p.data.to(torch.bfloat16)
    stepped = masters if precision == "bf16" else named
    if recipe == "adafactor":
        opts = [torch.optim.Adafactor(list(stepped.values()), lr=1e-2)]
    else:
        opts = [torch.optim.Muon([p for n, p in stepped.items() if is_matrix(n, p)], lr=0.02),
                torch.optim.AdamW([p for n, p in stepped.items() if not is_matrix(n, p)], lr=3e-3)]
    norms = []
    for step in range(STEPS):
        ids = batch(step, LOCAL_BATCH * world)
        # The global batch's gradient as data parallelism computes it: each rank's share's
        # gradient summed, then averaged (the same arithmetic, so the same bits)
        total: dict[str, torch.Tensor] = {}
        micro = LOCAL_BATCH // accumulation
        for k in range(accumulation):  # (each backward is reduced over the ranks, then accumulated)
            summed: dict[str, torch.Tensor] = {}
            for r in range(world):
                x = ids[r * LOCAL_BATCH + k * micro:r * LOCAL_BATCH + (k + 1) * micro]
                (model(input_ids=x, labels=x).loss * (weight(r, world, exact_sum) / accumulation)).backward()
                # (each rank's gradient, summed in fp32, as ZeroOptimizer reduces the bf16 ones too)
                for n, p in named.items():
                    summed[n] = p.grad.float().clone() if n not in summed else summed[n] + p.grad.float()
                model.zero_grad()
            for n, g in summed.items():
                g.mul_(1.0 / world)
                total[n] = g if n not in total else total[n] + g
        for n, p in stepped.items():
            p.grad = total[n]
        params = list(stepped.values())
        norms.append(exact_clip(params, max_norm) if clip == "exact" else
                     float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        for o in opts:
            o.step()
            o.zero_grad()
        model.zero_grad()
        if precision == "bf16":
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(masters[n])
    return {n: p.detach().float().clone() for n, p in named.items()}, norms


class Case(NamedTuple):
    recipe: str  # "muon" (Muon on the hidden matrices + AdamW) or "adafactor"
    stage: int
    max_norm: float = MAX_NORM
    clip: str = "exact"  # the reference's clipping: "exact" (exact_clip) or "torch" (clip_grad_norm_)
    precision: Optional[str] = None
    mesh: Optional[str] = None  # "hybrid": a (replicate 2, shard 2) mesh at world 4
    exact_sum: bool = False  # (world 4: ranks 2-3 weigh their loss 0, see ``weight``)
    offload: Optional[str] = None  # offload_optimizer
    accumulation: int = 1  # micro-batches per step

    @property
    def key(self) -> str:
        return "-".join([self.recipe, str(self.stage)] + (["noclip"] if self.max_norm == NO_CLIP else []) +
                        ([self.clip + "clip"] if self.clip != "exact" else []) + [x for x in (self.precision, self.mesh, self.offload) if x] +
                        ([f"acc{self.accumulation}"] if self.accumulation > 1 else []) +
                        (["exactsum"] if self.exact_sum else []))


def zero_run(case: Case, rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    model = llama()
    cls = torch.optim.Adafactor if case.recipe == "adafactor" else torch.optim.AdamW
    # (Muon orthogonalises in bf16, so an AdamW half that differs from torch's in the last bit -
    # the fused kernel's - moves the next gradients enough to flip bf16 roundings: torch's own
    # AdamW on the flat slices keeps the comparison exact)
    kw: dict[str, Any] = {"lr": 1e-2} if case.recipe == "adafactor" else {"fused_adam": False}
    if case.mesh == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if case.offload == "nvme":
        import tempfile
        kw["nvme_path"] = tempfile.mkdtemp(prefix="zs-whole-swap")
    opt = zeroshard.ZeroOptimizer(groups(model, case.recipe, zero=True), cls, stage=case.stage, module=model,
                                  mixed_precision=case.precision, offload_optimizer=case.offload, **kw)
    norms = []
    for step in range(STEPS):
        ids = batch(step, LOCAL_BATCH * world)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        micro = LOCAL_BATCH // case.accumulation
        for k in range(case.accumulation):
            x = ids[k * micro:(k + 1) * micro]
            (model(input_ids=x, labels=x).loss * (weight(rank, world, case.exact_sum) / case.accumulation)).backward()
        norms.append(float(opt.clip_grad_norm_(case.max_norm)))
        opt.step()
        opt.zero_grad()
    owners = {}
    for u in opt.units:  # which rank (of the shard group) updates each whole-tensor parameter
        for seg in u.layout.segments:
            owners[seg.name] = seg.offset // u.layout.shard_numel
    weights = {n: t.float() for n, t in zeroshard.full_state_dict(model, rank0_only=False).items()}
    opt.close()
    return weights, norms, owners


def compare(case: Case, rank: int, world: int) -> dict:
    ref, ref_norms = reference(case.recipe, world, case.max_norm, case.clip, case.precision, case.exact_sum,
                               case.accumulation)
    got, norms, owners = zero_run(case, rank, world)
    rel = max(float((got[n] - t).abs().max() / t.abs().max().clamp_min(1e-12)) for n, t in ref.items())
    # (bf16: relative to one bf16 ulp of the reference value, as tests/dist/test_parity.py bounds it)
    ulps = max(float(((got[n] - t).abs() / (t.abs() * 2.0**-7 + 1e-3)).max()) for n, t in ref.items())
    moved = max(float((t - llama().state_dict()[n]).abs().max()) for n, t in ref.items())
    return {"rel": rel, "ulp_ratio": ulps, "moved": moved, "norms": norms, "ref_norms": ref_norms, "owners": owners}


def cases(world: int) -> list[Case]:
    """The parity matrix at ``world`` ranks (every stage at world 2; the others sample it)."""
    if world == 1:
        return [Case("muon", 1), Case("muon", 3), Case("adafactor", 2), Case("muon", 3, precision="bf16"),
                Case("muon", 2, accumulation=2)]
    if world == 4:
        return ([Case("muon", stage, exact_sum=True) for stage in (1, 2, 3)] + [Case("muon", 2)] +
                [Case("adafactor", stage) for stage in (1, 2, 3)] +
                [Case("muon", 2, precision="bf16"), Case("adafactor", 3, precision="bf16")] +
                [Case("muon", stage, mesh="hybrid", exact_sum=True) for stage in (2, 3)] +
                [Case("adafactor", 3, mesh="hybrid"), Case("muon", 3, precision="bf16", mesh="hybrid")])
    out = [Case(recipe, stage) for recipe in ("muon", "adafactor") for stage in (0, 1, 2, 3)]
    out += [Case("muon", 3, NO_CLIP), Case("muon", 2, clip="torch"), Case("adafactor", 2, clip="torch")]
    out += [Case("muon", 2, precision="bf16"), Case("muon", 3, precision="bf16"), Case("adafactor", 3, precision="bf16")]
    out += [Case("muon", 3, offload="cpu"), Case("adafactor", 2, precision="bf16", offload="cpu")]
    out += [Case("adafactor", 2, offload="nvme"), Case("adafactor", 3, precision="bf16", offload="nvme")]
    out += [Case("muon", 3, accumulation=2), Case("adafactor", 2, accumulation=2)]
    return out


ALL_CASES = {world: cases(world) for world in (1, 2, 4)}


def worker(rank: int, world: int, out: str) -> None:
    results = {case.key: compare(case, rank, world) for case in cases(world)}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.barrier()


def run_one_process() -> dict:
    return {case.key: compare(case, 0, 1) for case in cases(1)}


if __name__ == "__main__":  # (debugging: python -m tests.support.whole_tensor_worker)
    print(json.dumps({k: {"rel": v["rel"]} for k, v in run_one_process().items()}, indent=1))


def _train(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        ids = batch(step, LOCAL_BATCH * world)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _built(recipe: str, stage: int, offload: Optional[str] = None) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    """(with NVMe, Muon's AdamW half runs on the fused kernel, which streams its moments)"""
    model = llama()
    cls = torch.optim.Adafactor if recipe == "adafactor" else torch.optim.AdamW
    kw: dict[str, Any] = {"lr": 1e-2} if recipe == "adafactor" else {"fused_adam": offload == "nvme"}
    if offload == "nvme":
        import tempfile
        kw.update(offload_optimizer="nvme", nvme_path=tempfile.mkdtemp(prefix="zs-whole-swap"))
    return model, zeroshard.ZeroOptimizer(groups(model, recipe, zero=True), cls, stage=stage, module=model, **kw)


def _state(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer) -> dict:
    """Weights, and the whole optimizer state by parameter name (consolidated: a collective)."""
    cons = opt.consolidated_state_dict(to_rank=None)
    names = [opt.engine.param_names[id(p)] for g in opt.param_groups for p in g["params"]]  # (the state's index order)
    return {"weights": zeroshard.full_state_dict(model, rank0_only=False),
            "state": {names[i]: s for i, s in cons["state"].items()}}


def resume_worker(rank: int, world: int, out: str, root: str, recipe: str, stage: int,
                  offload: Optional[str] = None) -> None:
    """Trains 3 steps, saves, trains 3 more (the reference); a fresh model and optimizer load
    the checkpoint and train the same 3 steps: equal bit for bit. Writes the loaded state for a
    reshard check at another world size."""
    model, opt = _built(recipe, stage, offload)
    _train(model, opt, range(3), rank, world)
    zeroshard.save_checkpoint(root, 3, model=model, optimizer=opt).wait()
    loaded_state = _state(model, opt)
    _train(model, opt, range(3, 6), rank, world)
    ref = _state(model, opt)
    opt.close()
    model, opt = _built(recipe, stage, offload)
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


def count_worker(rank: int, world: int, out: str) -> None:
    """Counts torch.optim.Muon's Newton-Schulz calls on this rank, per step, at stages 0-3 and at
    stage 3 from a meta-device model (the shapes it sees), and which state each parameter got
    (DeepSpeed's users found matrices silently on SGD at stage 0, or on AdamW under zero.Init)."""
    import torch.optim._muon as muon_impl
    real = muon_impl._zeropower_via_newtonschulz
    seen: list[list[int]] = []

    def counting(grad: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(list(grad.shape))
        return real(grad, *args)
    muon_impl._zeropower_via_newtonschulz = counting
    results = {}
    try:
        for stage, meta in ((0, False), (1, False), (2, False), (3, False), (3, True)):
            if meta:
                with torch.device("meta"):
                    model = llama()
            else:
                model = llama()
            opt = zeroshard.ZeroOptimizer(groups(model, "muon", zero=True), torch.optim.AdamW, stage=stage,
                                          module=model, fused_adam=False)
            if meta:
                zeroshard.init_meta_weights(model)
            calls = []
            for step in range(2):
                del seen[:]
                ids = batch(step, LOCAL_BATCH * world)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                calls.append(sorted(seen))
            state = _state(model, opt)["state"]
            results[f"{stage}{'-meta' if meta else ''}"] = {
                "calls": calls, "keys": {n: sorted(s) for n, s in state.items()}}
            opt.close()
    finally:
        muon_impl._zeropower_via_newtonschulz = real
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)


def torch_next_step(root: str, recipe: str, stage: int) -> dict:
    """One process: a ZeroOptimizer loads the checkpoint and takes a step; torch.optim.Muon and
    AdamW given the same weights and ``consolidated_state_dict()`` take the same step."""
    model, opt = _built(recipe, stage)
    zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    cons = opt.consolidated_state_dict()
    ref = llama()
    before = zeroshard.full_state_dict(model, rank0_only=False)
    ref.load_state_dict(before)
    rparams = dict(ref.named_parameters())
    groups = [[rparams[opt.engine.param_names[id(p)]] for p in g["params"]] for g in opt.param_groups]
    classes = [torch.optim.Muon, torch.optim.AdamW]
    opts, first = [], 0
    for cls, params, saved in zip(classes, groups, cons["param_groups"]):
        o = cls(params)
        ids = list(range(first, first + len(params)))
        first += len(params)
        o.load_state_dict({"state": {k - ids[0]: cons["state"][k] for k in ids if k in cons["state"]},
                           "param_groups": [{**{k: v for k, v in saved.items() if k in o.param_groups[0]},
                                             "params": [i - ids[0] for i in ids]}]})
        opts.append(o)
    ids = batch(9, LOCAL_BATCH)
    for m in (model, ref):
        m(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for o in opts:
        o.step()
    got = zeroshard.full_state_dict(model, rank0_only=False)
    return {"equal": all(torch.equal(got[n], p.detach()) for n, p in ref.named_parameters()),
            "moved": all(not torch.equal(got[n], before[n]) for n in got)}


def nvme_worker(rank: int, world: int, out: str) -> None:
    """Muon + AdamW (on the fused kernel, which NVMe streams) with the whole optimizer state on
    NVMe against the same in memory: weights and consolidated state equal after 8 steps."""
    results = {}
    for stage in (2, 3):
        runs = []
        for offload in (None, "nvme"):
            model, opt = _built("muon", stage, offload)
            if offload is None:  # (the same fused AdamW as under NVMe)
                opt.close()
                model = llama()
                opt = zeroshard.ZeroOptimizer(groups(model, "muon", zero=True), torch.optim.AdamW, stage=stage,
                                              module=model)
            _train(model, opt, range(STEPS), rank, world)
            runs.append((_state(model, opt), opt.memory_report()))
            opt.close()
        (mem, _), (nvme, report) = runs
        results[str(stage)] = {"equal": _equal(mem, nvme), "offloaded": report.offloaded}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
