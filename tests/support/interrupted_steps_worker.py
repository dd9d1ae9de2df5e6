"""Worker for tests/dist/test_interrupted_steps.py: stage 3 saved from between steps (after a forward
that raised, a forward with no backward, a backward that raised), resumed bit for bit; and a
stage-3 forward that one rank runs alone (evaluation on rank 0)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.models import TINY_GPT

CFG = TINY_GPT


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make(seed: int = 0, cfg: GPTConfig = CFG, **options):
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=3, **options)


def batch(step: int, cfg: GPTConfig = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's global batch (the same global batch at any world size)."""
    rank, world = _rank_world()
    x, y = synthetic_batch(step, 2 * world, cfg)
    return x[rank::world], y[rank::world]


def train(model, opt, start: int, stop: int, cfg: GPTConfig = CFG) -> None:
    for step in range(start, stop):
        model(*batch(step, cfg)).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def full(model) -> dict:
    return zeroshard.full_state_dict(model, rank0_only=False)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_state(o1, o2) -> bool:
    a, b = o1.consolidated_state_dict(to_rank=None), o2.consolidated_state_dict(to_rank=None)
    return a["state"].keys() == b["state"].keys() and all(
        sa.keys() == sb.keys() and all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
        for sa, sb in zip(a["state"].values(), b["state"].values()))


class _Interrupted(Exception):
    """Raised from inside backward, as Ctrl-C would be (the same point on every rank)."""


def _unfinished(model, opt, case: str):
    """Leaves an iteration unfinished the way ``case`` says; returns the graph kept, if any."""
    x, y = batch(2)
    if case == "forward_raised":
        try:
            model(x, y[:, :3])  # the loss fails after every unit was used (the root stays gathered)
        except (RuntimeError, ValueError):
            pass
        return None
    loss = model(x, y)
    if case == "no_backward":
        return loss
    # backward_raised: a hook in the middle of backward raises, with units gathered and
    # reductions in flight
    h = model.blocks[0].register_full_backward_hook(lambda *a: (_ for _ in ()).throw(_Interrupted()))
    try:
        loss.backward()
    except _Interrupted:
        pass
    h.remove()
    return None


def save_between_steps(rank: int, world: int, out: str, directory: str) -> None:
    res: dict = {}
    ref, ref_opt = make()
    train(ref, ref_opt, 0, 2)
    at2 = full(ref)
    m2, o2 = make(seed=3)
    train(ref, ref_opt, 2, 4)
    want = full(ref)
    for case in ("forward_raised", "no_backward", "backward_raised"):
        model, opt = make()
        train(model, opt, 0, 2)
        kept = _unfinished(model, opt, case)
        root = os.path.join(directory, case)
        try:
            zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)
        except Exception as exc:  # noqa: BLE001 - reported
            res[case] = f"save failed: {type(exc).__name__}: {exc}"
            continue
        m2, o2 = make(seed=3)
        zeroshard.load_checkpoint(root, model=m2, optimizer=o2)
        committed = same(full(m2), at2)
        train(m2, o2, 2, 4)
        resumed = same(full(m2), want)
        # and the interrupted run itself trains on as if nothing happened (the kept graph too)
        if kept is not None:
            kept.backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            train(model, opt, 3, 4)
        else:
            opt.zero_grad()
            train(model, opt, 2, 4)
        res[case] = {"committed": committed, "resumed": resumed, "continued": same(full(model), want),
                     "state": same_state(opt, ref_opt)}
        opt.close()
        o2.close()
    # A backward that raised, then training goes on with no save in between: the next pass
    # starts afresh (its end-of-backward callback was never run).
    model, opt = make()
    train(model, opt, 0, 2)
    _unfinished(model, opt, "backward_raised")
    opt.zero_grad()
    train(model, opt, 2, 4)
    res["backward_raised_train_on"] = {"equal": same(full(model), want),
                                       "released": opt.engine.gatherer.gathered_bytes() == 0}
    # issue 29: full_state_dict of a torch.compile wrapper gathers the full weights (keys as the
    # wrapper's state_dict has them), not this rank's pieces
    compiled = torch.compile(model, backend="eager")
    got, plain = zeroshard.full_state_dict(compiled, rank0_only=False), full(model)
    res["compiled_full_state"] = (sorted(got) == sorted(f"_orig_mod.{k}" for k in plain)
                                  and all(torch.equal(got[f"_orig_mod.{k}"], v) for k, v in plain.items()))
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def lone_forward(rank: int, world: int, out: str, directory: str) -> None:
    """2 ranks: evaluation on every rank works and what its agreement costs; a collected
    optimizer leaves sharded parameters that read correctly; then rank 0 evaluates alone while
    rank 1 trains (nanoGPT's estimate_loss under master_process)."""
    import gc
    import warnings
    res: dict = {}
    torch.manual_seed(0)
    ref = TinyGPT(CFG)  # (the unsharded reference: same init as make())
    model, opt = make()
    x, y = batch(0)
    with torch.no_grad():  # every rank evaluates: agreed once per evaluation, the same loss as unsharded
        res["eval_all"] = all(model(*batch(s)).item() == ref(*batch(s)).item() for s in range(3))
        res["checks"] = opt.engine.gatherer.forward_check.count
        t0 = time.perf_counter()
        model(x, y)
        forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        opt.engine.gatherer.forward_check.check(model)
    res["check_seconds"] = (time.perf_counter() - t0) / 20
    res["forward_seconds"] = forward
    model(x, y).backward()  # (a training forward: the next evaluation agrees again)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(x, y)
    res["checks_after_training"] = opt.engine.gatherer.forward_check.count
    ref = TinyGPT(CFG)  # (unsharded, with the weights after that step)
    ref.load_state_dict(zeroshard.full_state_dict(model, rank0_only=False))
    # del opt at 2 ranks: no collective can run from a finalizer; the sharded parameters stay
    # registered, their shards in memory, and give the global values
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del opt
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (ops a sharded tensor answers by gathering warn once)
        got = model.state_dict()
        res["collected_pieces"] = all(  # each rank's piece, in memory, with the trained values
            type(got[k]).__name__ == "ShardedTensor"
            and torch.equal(got[k].local, want[k].reshape(-1)[got[k].start:got[k].start + got[k].n]) for k in want)
        with torch.no_grad():
            res["collected_forward"] = model(x, y).item() == ref(x, y).item()
    del model, got
    # rank 0 evaluates alone; rank 1 goes on to train
    model, opt = make()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        if rank == 0:
            with torch.no_grad():
                model(x, y)
        else:
            model(x, y).backward()
            opt.step()
        res["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        res["error"] = f"{type(exc).__name__}: {exc}"
    res["seconds"] = time.perf_counter() - t0
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)
    with warnings.catch_warnings():  # (its process group timed out: the hand-back cannot gather)
        warnings.simplefilter("ignore")
        del model, opt
        gc.collect()


def sigint_child(root: str, nvme: str) -> None:
    """Trains stage 3 with NVMe offload and the overlapped step until SIGUSR1, saving on each of
    20 Ctrl-Cs (SIGINT) at whatever point it lands: the README's "Save on interrupt" pattern, then
    resuming from that save in place. Reports on stdout: ``ready``, ``saved I STEP PHASE``, ``resumed I``, ``done STEP``."""
    import random
    import signal
    import threading
    from tests.support.nvme_params_worker import AUTO_CFG
    from tests.support.nvme_params_worker import make as make_nvme
    model, opt = make_nvme(nvme, "bf16", cfg=AUTO_CFG, overlap_step=True)
    stop = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append(True))
    phase = ["start"]
    interrupts = 0
    # Each Ctrl-C is aimed at one part of the iteration in turn, a random delay after it starts,
    # by a timer in this process (a parent reading a pipe lags by whole iterations); the signal
    # itself is a real SIGINT, handled by Python wherever the main thread then is.
    rng = random.Random(28)
    # (ZEROSHARD_TEST_SIGINT_TARGETS=backward,step,... aims them elsewhere, to chase a failure)
    targets = tuple(os.environ.get("ZEROSHARD_TEST_SIGINT_TARGETS", "forward,backward,step,in_flight").split(","))
    armed: list = []

    def at(name: str) -> None:
        phase[0] = name
        if not armed and interrupts < 20 and name == targets[interrupts % len(targets)]:
            timer = threading.Timer(rng.uniform(0.0, 0.02 if name in ("forward", "backward") else 0.004),
                                    os.kill, (os.getpid(), signal.SIGINT))
            armed.append(timer)
            timer.start()
    print("ready", flush=True)
    while True:
        try:
            while not stop:
                x, y = synthetic_batch(opt.steps_done, 2, AUTO_CFG)  # (the data follows the steps done)
                at("forward")
                loss = model(x, y)
                at("backward")
                loss.backward()
                opt.clip_grad_norm_(0.5)
                at("step")
                opt.step()
                at("in_flight")  # (the step goes on in the background while the next forward gathers)
                opt.zero_grad()
            break
        except KeyboardInterrupt:
            armed.pop().join()
            step = opt.steps_done
            path = os.path.join(root, f"int{interrupts:02d}")
            zeroshard.save_checkpoint(path, step, model=model, optimizer=opt)
            print(f"saved {interrupts} {step} {phase[0]}", flush=True)
            zeroshard.load_checkpoint(path, model=model, optimizer=opt)  # go on from the save
            opt.zero_grad()
            interrupts += 1
            print(f"resumed {interrupts - 1}", flush=True)
    zeroshard.save_checkpoint(os.path.join(root, "final"), opt.steps_done, model=model, optimizer=opt)
    print(f"done {opt.steps_done}", flush=True)
    opt.close()


def main() -> None:
    """``python -m tests.support.interrupted_steps_worker save DIR``: one rank in-process (no process
    group); ``... sigint ROOT NVME``: the child of the Ctrl-C test."""
    if sys.argv[1] == "sigint":
        sigint_child(sys.argv[2], sys.argv[3])
        return
    _, directory = sys.argv[1:3]
    save_between_steps(0, 1, os.path.join(directory, "res"), directory)


if __name__ == "__main__":
    main()
