"""The memory tier's faults (issue 45, Note [peer memory tier] in zeroshard/resilience/memory_tier.py):
a torn slot falls back to the previous step, a tier of another run or model is refused (never
loaded), a full tmpfs turns the tier off with a warning while training goes on; and the options."""
from __future__ import annotations

import os
import resource
import shutil
import signal
import uuid

import pytest
import torch

import zeroshard
from zeroshard import cli
from zeroshard.checkpoint import CheckpointError


@pytest.fixture
def tier():
    path = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def build(tier: str, run_id: str = "r", width: int = 16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 4))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id=run_id, every=1))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def train(model, opt, sched, steps: int, root=None, save_at=None) -> list[list[torch.Tensor]]:
    """Trains ``steps`` steps committing each to the tier; the parameters after each step."""
    seen = []
    for step in range(1, steps + 1):
        loss = model(torch.full((4, 8), float(step))).square().mean()
        opt.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step == save_at:
            zeroshard.save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched)
        zeroshard.memory_checkpoint(step, model=model, optimizer=opt, scheduler=sched)
        seen.append([p.detach().clone() for p in model.parameters()])
    opt.engine.memory_tier.wait()
    return seen


def test_torn_newest_slot_falls_back_to_the_previous_step(tier, tmp_path, capsys):
    model, opt, sched = build(tier)
    seen = train(model, opt, sched, 3)
    own = os.path.join(tier, "rank-0", "own")
    newest = max(os.listdir(own), key=lambda s: os.path.getmtime(os.path.join(own, s, "stamp.json")))
    with open(os.path.join(own, newest, "data.bin"), "r+b") as f:  # one flipped byte, as a kill mid-copy leaves
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli.main(["inspect", tier]) == 1  # `zeroshard inspect` shows the tier: the torn slot, what is covered
    shown = capsys.readouterr().out
    assert "rank-0/own     rank 0's state, step 3, world size 1, run 'r'" in shown and "INVALID (" in shown
    assert "step 2 (run 'r', world size 1): ranks [0] covered: recoverable from memory" in shown
    model2, opt2, sched2 = build(tier)
    with pytest.warns(UserWarning, match="torn slot"):
        info = zeroshard.load_checkpoint(str(tmp_path / "none"), model=model2, optimizer=opt2, scheduler=sched2)
    assert (info["step"], info["source"], info["bytes_read"]) == (2, "memory", 0)
    assert all(torch.equal(a, b) for a, b in zip(seen[1], model2.parameters()))
    assert sched2.last_epoch == 2


def test_tier_of_another_run_or_model_is_refused_never_loaded(tier, tmp_path, capfd):
    root = str(tmp_path / "ckpt")
    model, opt, sched = build(tier, run_id="a")
    seen = train(model, opt, sched, 3, root=root, save_at=1)
    model2, opt2, sched2 = build(tier, run_id="b")
    with pytest.warns(UserWarning, match="not this run 'b'"):
        info = zeroshard.load_checkpoint(root, model=model2, optimizer=opt2, scheduler=sched2)
    assert info["step"] == 1 and info.get("source") is None  # the disk's step 1, not the tier's step 3
    assert all(torch.equal(a, b) for a, b in zip(seen[0], model2.parameters()))
    assert "loading from the disk checkpoint, not the memory tiers" in capfd.readouterr().out
    model3, opt3, sched3 = build(tier, run_id="a", width=12)  # same run id, another model
    with pytest.warns(UserWarning, match="another model"), pytest.raises(CheckpointError, match="no checkpoint"):
        zeroshard.load_checkpoint(str(tmp_path / "none"), model=model3, optimizer=opt3, scheduler=sched3)


def test_full_tmpfs_turns_the_tier_off_with_a_warning_and_training_goes_on(tier):
    own = os.path.join(tier, "rank-0", "own")
    for slot in ("slot-0", "slot-1"):  # every write into the tier fails as on a full tmpfs (ENOSPC)
        os.makedirs(os.path.join(own, slot))
        os.symlink("/dev/full", os.path.join(own, slot, "data.bin"))
    model, opt, sched = build(tier)
    with pytest.warns(UserWarning, match="No space left on device.*Training goes on"):
        seen = train(model, opt, sched, 3)
    assert opt.engine.memory_tier.disabled is not None and len(seen) == 3
    assert not zeroshard.memory_checkpoint(4, model=model, optimizer=opt, scheduler=sched)


def test_memory_report_counts_the_tier_and_options_are_checked(tier):
    model, opt, sched = build(tier)
    assert opt.memory_report().memory_tier == 0
    train(model, opt, sched, 2)
    held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tier, "rank-0")) for f in fs)
    data = sum(os.path.getsize(os.path.join(tier, "rank-0", "own", s, "data.bin")) for s in ("slot-0", "slot-1"))
    # the state is copied straight into the mapped slots: no staging buffer besides them
    assert opt.engine.memory_tier.buffer_bytes() == 0 and opt.engine.memory_tier._staging is None
    assert opt.memory_report().memory_tier == held and held > data > 0
    with pytest.raises(ValueError, match="every=0"):
        zeroshard.PeerRedundancy(every=0)
    with pytest.raises(ValueError, match="every='sometimes'.* must be 'auto' or an int"):
        zeroshard.PeerRedundancy(every="sometimes")
    with pytest.raises(ValueError, match="max_every=0"):
        zeroshard.PeerRedundancy(max_every=0)
    with pytest.raises(ValueError, match="auto_budget=1.5"):
        zeroshard.PeerRedundancy(auto_budget=1.5)
    assert zeroshard.PeerRedundancy().every == "auto"
    with pytest.raises(ValueError, match="redundancy='mirror'"):
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, redundancy="mirror")
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="NVMe offload"):
        zeroshard.ZeroOptimizer(other, torch.optim.AdamW, offload_optimizer="nvme", nvme_path=tier, redundancy="peer")
    with pytest.raises(ValueError, match="redundancy='peer'"):
        zeroshard.memory_checkpoint(1, model=other, optimizer=zeroshard.ZeroOptimizer(other, torch.optim.AdamW))


def test_commit_holds_the_state_of_its_step_though_the_next_forward_and_step_change_it(tier, tmp_path):
    """The copy runs on the tier's thread: buffers a forward changes are taken at the call, and
    the next ``opt.step()`` waits for the copy (Note [peer memory tier])."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64),
                                    torch.nn.Linear(64, 1 << 15))  # (state to copy: 2 M parameters, before the buffers)
        return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2,
                                              redundancy=zeroshard.PeerRedundancy(path=tier, run_id="bn", every=1))
    model, opt = make()
    x = torch.randn(16, 8)
    for step in range(1, 4):
        opt.backward(model(x * step).square().mean())
        opt.step()
        opt.zero_grad()
        zeroshard.memory_checkpoint(step, model=model, optimizer=opt)
        if step == 3:
            state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.backward(model(x * 5).square().mean())  # changes the running statistics at once
    opt.step()  # changes the parameters: waits for step 3's copy first
    opt.engine.memory_tier.wait()
    model2, opt2 = make()
    info = zeroshard.load_checkpoint(str(tmp_path / "none"), model=model2, optimizer=opt2)
    assert (info["step"], info["source"]) == (3, "memory")
    got = model2.state_dict()
    assert all(torch.equal(state[k], got[k]) for k in state), [k for k in state if not torch.equal(state[k], got[k])]


def test_no_room_for_a_mapped_slot_turns_the_tier_off_without_a_sigbus(tier):
    """The slots are mapped: their space is reserved first (fallocate), so a tmpfs without room
    answers an error there, not a SIGBUS at a store through the mapping (here the room is cut by
    RLIMIT_FSIZE: EFBIG on the same path as ENOSPC)."""
    model, opt, sched = build(tier, width=4096)  # (about 0.5 MB of state per slot)
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, old_limit[1]))
    try:
        with pytest.warns(UserWarning, match="File too large.*Training goes on"):
            seen = train(model, opt, sched, 3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert opt.engine.memory_tier.disabled is not None and len(seen) == 3
