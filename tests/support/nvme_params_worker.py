"""Worker for tests/offload/test_offload_params_nvme.py: one gloo rank trains TinyGPT at stage 3,
in memory and with parameters + optimizer state in swap files, and reports both."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.models import TINY_GPT

CFG = TINY_GPT


def make(nvme: str | None, mixed_precision: str | None = None, seed: int = 0, stage: int = 3,
         optimizer: str | None = "nvme", params: str | None = "nvme", cfg: GPTConfig = CFG, **options):
    """TinyGPT and its ZeroOptimizer; ``nvme=None`` keeps everything in memory."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    on = nvme is not None or optimizer == "cpu"
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage,
                                  mixed_precision=mixed_precision, offload_optimizer=optimizer if on else None,
                                  offload_params=params if on and stage == 3 else None, nvme_path=nvme, **options)
    return model, opt


def train(model, opt, start: int, steps: int, accum: int = 1) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, start + steps):
        for k in range(accum):
            x, y = synthetic_batch(step * accum + k, 2 * world, CFG)
            model(x[rank::world], y[rank::world]).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def run(rank: int, world: int, out: str, directory: str) -> None:
    swap = os.path.join(directory, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    res: dict = {}
    for mp in (None, "bf16"):
        ref, ref_opt = make(None, mp)
        got, opt = make(swap, mp)
        train(ref, ref_opt, 0, 3, accum=2)
        train(got, opt, 0, 3, accum=2)
        a, b = zeroshard.full_state_dict(ref, rank0_only=False), zeroshard.full_state_dict(got, rank0_only=False)
        res[f"equal_{mp}"] = all(torch.equal(a[k], b[k]) for k in a)
        rep = opt.memory_report()
        res[f"resident_{mp}"] = rep.parameters + rep.gradients + rep.master_weights
        res[f"offloaded_{mp}"] = rep.offloaded
        # Checkpoint from the swap files, resume in a fresh swapped optimizer and in memory.
        root = os.path.join(directory, f"ckpt_{mp}")
        zeroshard.save_checkpoint(root, 3, model=got, optimizer=opt)
        train(ref, ref_opt, 3, 2)
        want = zeroshard.full_state_dict(ref, rank0_only=False)
        for target in ("swap", "memory"):
            m2, o2 = make(swap if target == "swap" else None, mp, seed=1)
            zeroshard.load_checkpoint(root, model=m2, optimizer=o2)
            train(m2, o2, 3, 2)
            c = zeroshard.full_state_dict(m2, rank0_only=False)
            res[f"resumed_{mp}_{target}"] = all(torch.equal(want[k], c[k]) for k in want)
        # The plain torch.optim view of the swapped state equals the in-memory one.
        train(got, opt, 3, 2)
        p, q = ref_opt.consolidated_state_dict(to_rank=None), opt.consolidated_state_dict(to_rank=None)
        res[f"consolidated_{mp}"] = all(torch.equal(v, q["state"][i][k]) for i, st in p["state"].items()
                                        for k, v in st.items())
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def save_swapped(rank: int, world: int, out: str, directory: str) -> None:
    """Trains 2 steps with parameters and state in swap files and saves a checkpoint."""
    swap = os.path.join(directory, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    model, opt = make(swap, "bf16")
    train(model, opt, 0, 2, accum=2)
    zeroshard.save_checkpoint(os.path.join(directory, "ckpt"), 2, model=model, optimizer=opt)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"saved": True}, f)


def run_matrix(rank: int, world: int, out: str, directory: str) -> None:
    """Every offload placement at stages 1-3 against the same run in memory, fp32 and bf16."""
    swap = os.path.join(directory, f"matrix{rank}")
    os.makedirs(swap, exist_ok=True)
    res: dict = {}
    for stage in (1, 2, 3):
        placements = [("cpu", None), ("nvme", None)] + ([("cpu", "cpu"), ("nvme", "nvme")] if stage == 3 else [])
        for mp in (None, "bf16"):
            ref, ref_opt = make(None, mp, stage=stage, optimizer=None, params=None)
            train(ref, ref_opt, 0, 2, accum=2)
            want = zeroshard.full_state_dict(ref, rank0_only=False)
            for optimizer, params in placements:
                model, opt = make(swap if "nvme" in (optimizer, params) else None, mp, stage=stage,
                                  optimizer=optimizer, params=params)
                train(model, opt, 0, 2, accum=2)
                got = zeroshard.full_state_dict(model, rank0_only=False)
                res[f"stage{stage}-{mp}-optim_{optimizer}-params_{params}"] = all(
                    torch.equal(want[k], got[k]) for k in want)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


AUTO_CFG = GPTConfig(vocab=64, d_model=32, n_layers=8, n_heads=4, seq_len=8)
"""CFG with 8 blocks: at stage 3 placement has 9 units to choose among."""


def small_units(stage: int) -> dict:
    """Stages 1-2: buckets of about 1k parameters, so they too have a dozen units to place."""
    return {"cfg": AUTO_CFG} if stage == 3 else {"cfg": AUTO_CFG, "bucket_size_mb": 0.005}


def make_auto(nvme: str, budget, mixed_precision: str | None = None, stage: int = 3, seed: int = 0):
    """TinyGPT under offload="auto" with ``budget`` (bytes of host memory, this machine's one memory)
    for the state alone (reserve 0: the process's own memory, measured, would make plans depend
    on what ran before in the same process)."""
    options = small_units(stage)
    torch.manual_seed(seed)
    model = TinyGPT(options.pop("cfg"))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage,
                                  mixed_precision=mixed_precision, offload="auto",
                                  memory_budget={"host": budget, "reserve": 0},
                                  nvme_path=nvme, **options)
    return model, opt


def auto_budgets(nvme: str, mixed_precision: str | None, stage: int) -> dict[str, int]:
    """Budgets where everything fits, about half the state fits, and only the minimum does."""
    from zeroshard.planner.auto_placement import PlacementError
    try:
        make_auto(nvme, 0, mixed_precision, stage)
    except PlacementError as exc:
        minimum = exc.minimum["host"]
    else:
        raise AssertionError("a zero budget was accepted")
    _, opt = make_auto(nvme, 2**40, mixed_precision, stage)
    state = sum(b for kind in opt.placement_report()["bytes"].values() for b in kind.values())
    return {"all": 2**40, "half": minimum + state // 2, "minimum": minimum}


def run_auto_matrix(rank: int, world: int, out: str, directory: str) -> None:
    """offload="auto" at stages 1-3, fp32 and bf16, at budgets where everything, half and only the
    minimum fits: the same bits as the all-resident run, and what each placed and streamed."""
    swap = os.path.join(directory, f"auto{rank}")
    os.makedirs(swap, exist_ok=True)
    res: dict = {}
    for stage in (1, 2, 3):
        for mp in (None, "bf16"):
            ref, ref_opt = make(None, mp, stage=stage, optimizer=None, params=None, **small_units(stage))
            train(ref, ref_opt, 0, 2, accum=2)
            want = zeroshard.full_state_dict(ref, rank0_only=False)
            for name, budget in auto_budgets(swap, mp, stage).items():
                model, opt = make_auto(swap, budget, mp, stage)
                train(model, opt, 0, 2, accum=2)
                got = zeroshard.full_state_dict(model, rank0_only=False)
                rep = opt.placement_report()
                res[f"stage{stage}-{mp}-{name}"] = {
                    "equal": all(torch.equal(want[k], got[k]) for k in want),
                    "nvme_bytes": sum(kind["nvme"] for kind in rep["bytes"].values()),
                    "memory_bytes": sum(b for kind in rep["bytes"].values() for t, b in kind.items() if t != "nvme"),
                    "cached": len(rep["cache"]["units"]), "swapper": opt.engine.joined().swapper is not None}
                opt.close()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def auto_resume(rank: int, world: int, out: str, directory: str) -> None:
    """A checkpoint saved under one automatic placement resumes under another and in memory,
    bit for bit (stage 3, bf16)."""
    swap = os.path.join(directory, f"resume{rank}")
    os.makedirs(swap, exist_ok=True)
    budgets = auto_budgets(swap, "bf16", 3)
    ref, ref_opt = make(None, "bf16", stage=3, optimizer=None, params=None, cfg=AUTO_CFG)
    train(ref, ref_opt, 0, 4)
    want = zeroshard.full_state_dict(ref, rank0_only=False)
    model, opt = make_auto(swap, budgets["half"], "bf16")
    train(model, opt, 0, 2)
    root = os.path.join(directory, "ckpt")
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)
    res = {}
    for name in ("minimum", "memory"):
        if name == "memory":
            m2, o2 = make(None, "bf16", stage=3, optimizer=None, params=None, cfg=AUTO_CFG, seed=1)
        else:
            m2, o2 = make_auto(swap, budgets[name], "bf16", seed=1)
        zeroshard.load_checkpoint(root, model=m2, optimizer=o2)
        train(m2, o2, 2, 2)
        got = zeroshard.full_state_dict(m2, rank0_only=False)
        res[name] = all(torch.equal(want[k], got[k]) for k in want)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def budget_covers_process(rank: int, world: int, out: str, directory: str, share: float) -> None:
    """In a fresh process: a budget of the minimum plus ``share`` of the state, with the process's own
    memory measured (no reserve given); the resident peak of steps 2-4, sampled every 2 ms by a
    thread of this worker, against it."""
    import threading
    import time
    from zeroshard.offload.peak_memory import resident_bytes
    from zeroshard.planner.auto_placement import PlacementError
    cfg = GPTConfig(vocab=1024, d_model=512, n_layers=6, n_heads=8, seq_len=32)
    peak, sampling, done = [0], [False], [False]

    def sample() -> None:
        while not done[0]:
            if sampling[0]:
                peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)
    threading.Thread(target=sample, daemon=True).start()

    def build(budget: int):
        with torch.device("meta"):
            model = TinyGPT(cfg)
        return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=3, offload="auto",
                                              memory_budget={"host": budget}, nvme_path=directory)
    try:
        build(1)
    except PlacementError as exc:
        minimum, state = exc.minimum["host"], exc.state
    budget = minimum + int(state * share)
    model, opt = build(budget)
    zeroshard.init_meta_weights(model, seed=0)
    for step in range(4):
        sampling[0] = step > 0
        model(*synthetic_batch(step, 2, cfg)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    done[0] = True
    rep = opt.placement_report()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"budget": budget, "state": state, "peak": peak[0], "predicted": rep["predicted_memory"]["host"],
                   "peaks": rep["peak_memory"], "in_memory": sum(v["host"] for v in rep["bytes"].values()),
                   "streamed": sum(v["nvme"] for v in rep["bytes"].values())}, f)


def run_overlap(rank: int, world: int, out: str, directory: str) -> None:
    """Note [overlapped step]: stage 3 with everything in swap files, the step overlapped with
    the next forward and not, and in memory, under an LR schedule, clipping, accumulation, an
    evaluation forward right after each step and a checkpoint saved with a step in flight:
    the same bits everywhere."""
    swap = os.path.join(directory, f"ov{rank}")
    os.makedirs(swap, exist_ok=True)
    res: dict = {}
    for mp in (None, "bf16"):
        runs = {"memory": make(None, mp, cfg=AUTO_CFG), "sync": make(swap, mp, cfg=AUTO_CFG, overlap_step=False),
                "overlap": make(swap, mp, cfg=AUTO_CFG, overlap_step=True)}
        seen: dict = {}
        for name, (model, opt) in runs.items():
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            losses, evals, in_flight = [], [], []
            for step in range(4):
                for k in range(2):
                    x, y = synthetic_batch(step * 2 + k, 2 * world, AUTO_CFG)
                    loss = model(x[rank::world], y[rank::world])
                    loss.backward()
                    losses.append(loss.item())
                opt.clip_grad_norm_(0.5)
                opt.step()
                in_flight.append(opt.engine.inflight.running)
                sched.step()  # (changes lr while the step may still run: it took a copy)
                opt.zero_grad(set_to_none=step != 2)
                if step == 1:  # the state after step 2, saved as soon as step() returned
                    zeroshard.save_checkpoint(os.path.join(directory, f"ck_{mp}_{name}"), 2, model=model,
                                              optimizer=opt)
                with torch.no_grad():
                    evals.append(model(*synthetic_batch(100, 2, AUTO_CFG)).item())
            state = zeroshard.full_state_dict(model, rank0_only=False)
            seen[name] = (losses, evals, state, opt.consolidated_state_dict(to_rank=None))
            res[f"{mp}-{name}-in_flight"] = in_flight
            opt.close()
        want = seen["memory"]
        for name in ("sync", "overlap"):
            got = seen[name]
            res[f"{mp}-{name}"] = (got[0] == want[0] and got[1] == want[1]
                                   and all(torch.equal(want[2][k], got[2][k]) for k in want[2])
                                   and all(torch.equal(a, b) for sa, sb in zip(want[3]["state"].values(),
                                                                               got[3]["state"].values())
                                           for a, b in zip(sa.values(), sb.values())))
        # The checkpoint saved with the step in flight resumes to the same bits.
        model, opt = make(swap, mp, cfg=AUTO_CFG, seed=5, overlap_step=True)
        zeroshard.load_checkpoint(os.path.join(directory, f"ck_{mp}_overlap"), model=model, optimizer=opt)
        ref, ref_opt = make(None, mp, cfg=AUTO_CFG, seed=5)
        zeroshard.load_checkpoint(os.path.join(directory, f"ck_{mp}_memory"), model=ref, optimizer=ref_opt)
        a, b = zeroshard.full_state_dict(ref, rank0_only=False), zeroshard.full_state_dict(model, rank0_only=False)
        res[f"{mp}-checkpoint"] = all(torch.equal(a[k], b[k]) for k in a)
        opt.close()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)
