"""What changes the state between ``memory_checkpoint`` and the next step waits for the tier's
copy in flight (Note [peer memory tier] in zeroshard/resilience/memory_tier.py): a module's
``load_state_dict`` (a pre-hook the commit registers) and ``opt.close()``. The copy is held
deterministically: the tier's thread waits for the test before it copies. And the handoff in
one process (the multi-rank handoff: tests/dist/test_peer_recovery.py)."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import uuid

import pytest
import torch

import zeroshard
from zeroshard.train.preemption import PreemptionHandler


@pytest.fixture
def tier():
    path = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def build(tier: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="waits", every=1))
    return model, opt


def step(model, opt, n: int) -> None:
    opt.backward(model(torch.full((4, 8), float(n))).square().mean())
    opt.step()
    opt.zero_grad()


def hold_copy(tier) -> threading.Event:
    """The tier's thread waits for the returned event before it copies the state into its own slot."""
    release, target = threading.Event(), tier._target

    def held(directory: str, size: int):
        if directory == tier.own_dir:
            release.wait()
        return target(directory, size)
    tier._target = held
    return release


def blocked_in(call, entered: threading.Event) -> bool:
    """Starts ``call`` on a thread; True when it reached ``entered`` (and still runs: held)."""
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    while worker.is_alive() and not entered.wait(0.01):
        pass
    return entered.is_set() and worker.is_alive()


def test_load_state_dict_and_close_wait_for_the_copy_in_flight(tier, tmp_path):
    model, opt = build(tier)
    t = opt.engine.memory_tier
    step(model, opt, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release = hold_copy(t)
    zeroshard.memory_checkpoint(1, model=model, optimizer=opt)
    done, entered = t._copy_done, threading.Event()

    class Seen:  # the copy's event, telling the test when someone waits on it
        def wait(self, timeout=None):
            entered.set()
            return done.wait(timeout)
    t._copy_done = Seen()
    changed = {k: v + 1 for k, v in model[1].state_dict().items()}
    waited = blocked_in(lambda: model[1].load_state_dict(changed), entered)
    release.set()
    t.wait()
    assert waited, "model.load_state_dict did not wait for the memory tier's copy in flight"
    model2, opt2 = build(tier)
    info = zeroshard.load_checkpoint(str(tmp_path / "none"), model=model2, optimizer=opt2)
    assert (info["step"], info["source"]) == (1, "memory")
    got = model2.state_dict()
    assert all(torch.equal(before[k], got[k]) for k in before)  # the copy holds step 1, not the load's values

    step(model, opt, 2)
    release = hold_copy(t)
    zeroshard.memory_checkpoint(2, model=model, optimizer=opt)
    entered, wait = threading.Event(), t.wait

    def seen_wait() -> None:
        entered.set()
        wait()
    t.wait = seen_wait
    closing = blocked_in(opt.close, entered)
    second = threading.Thread(target=wait, daemon=True)  # (a second waiter while close() waits: it waits too)
    second.start()
    second.join(0.3)
    held = second.is_alive()
    release.set()
    wait()
    second.join()
    assert closing, "opt.close() did not wait for the memory tier's commit in flight"
    assert held, "a second wait() returned while the commit was still in flight (close() had taken the thread)"


def test_handoff_commits_the_agreed_step_past_every_and_reports_the_grace(tier, tmp_path):
    """One process: the handoff forces the commit of a step ``every`` skips, and a handoff later
    than the grace budget says so (Note [preemption handoff]); a bad budget is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="waits", every=2))
    preemption = PreemptionHandler(signals=(signal.SIGUSR2,), grace_s=0.001).install()
    try:
        for n in (1, 2, 3):
            step(model, opt, n)
            assert zeroshard.memory_checkpoint(n, model=model, optimizer=opt) == (n == 2)
        os.kill(os.getpid(), signal.SIGUSR2)
        while not preemption.requested:  # (delivered between bytecodes of this thread)
            pass
        assert preemption.agree()[0]
        with pytest.warns(UserWarning, match="past the grace budget of 0.001 s"):
            info = zeroshard.memory_handoff(3, preemption=preemption, model=model, optimizer=opt)
    finally:
        preemption.uninstall()
    assert (info["step"], info["handed_off"], info["leaving"], info["pairs"]) == (3, True, [0], [])
    model2, opt2 = build(tier)
    assert zeroshard.load_checkpoint(str(tmp_path / "none"), model=model2, optimizer=opt2)["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    with pytest.raises(ValueError, match="grace_s=0"):
        PreemptionHandler(grace_s=0)
    with pytest.raises(ValueError, match="redundancy='peer'"):
        zeroshard.memory_handoff(3, preemption=preemption, model=model, optimizer=zeroshard.ZeroOptimizer(
            torch.nn.Linear(2, 2), torch.optim.AdamW))


def test_train_loop_preempted_hands_off_then_resumes_from_memory_without_the_disk(tier, tmp_path):
    """``TrainLoop`` (``zeroshard finetune``'s loop) with ``redundancy="peer"``: the agreed
    preemption hands the step to the memory tier before its disk save, and a new loop resumes
    it from memory with the disk checkpoint gone (Note [preemption handoff])."""
    from zeroshard.data.sampler import ResumableSampler
    from zeroshard.train.faults import Fault
    from zeroshard.train.loop import LoopSettings, TrainLoop
    from zeroshard.train.progress import Progress
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out")

    def make(preemption: PreemptionHandler, fault=None):
        model, opt = build(tier)
        sampler = ResumableSampler(data, num_replicas=1, rank=0, seed=0)
        loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return model, TrainLoop(LoopSettings(max_steps=6, checkpoint_root=root, save_interval=100), model, opt, sched,
                                loader, sampler, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                                Progress(out, 0, 6, 4, bar=False), preemption, fault=fault)
    with PreemptionHandler(signals=(signal.SIGUSR1,)) as preemption:  # (a real signal, mid-step 3)
        model, loop = make(preemption, Fault("sigusr1", 0, 3))
        assert loop.resume() is None and loop.run() == "preempted" and loop.step == 3
    loop.progress.close()
    with open(os.path.join(out, "logs", "rank-00000.log")) as f:
        assert "step 3 handed to the memory tiers" in f.read()
    shutil.rmtree(root)  # the disk checkpoint the loop saved after the handoff is gone
    with PreemptionHandler() as preemption:
        model2, loop2 = make(preemption)
        assert loop2.resume() == f"memory:{tier}" and loop2.step == 3
    loop2.progress.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
