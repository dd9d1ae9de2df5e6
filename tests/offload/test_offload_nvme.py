"""offload_optimizer='nvme': bit-identical to in-memory state, streams through checkpoints
and state dicts, and fails clearly on bad disks."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

import zeroshard
from zeroshard.io import AIOError, DiskFullError, TruncatedFileError
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.io_helpers import mount_tmpfs
from tests.support.asserts import assert_same
from tests.support.models import TINY_GPT

CFG = TINY_GPT


def _train(stage: int, nvme: str | None, steps: int = 4, model=None, opt=None, start: int = 0):
    if model is None:
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage,
                                      offload_optimizer="nvme" if nvme else None, nvme_path=nvme)
    for step in range(start, start + steps):
        model(*synthetic_batch(step, 4, CFG)).backward()
        opt.clip_grad_norm_(0.5)  # the clip coefficient rides in the fused pass
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_nvme_state_is_bit_identical(stage, tmp_path):
    ref, _ = _train(stage, None)
    got, opt = _train(stage, str(tmp_path))
    a, b = zeroshard.full_state_dict(ref), zeroshard.full_state_dict(got)
    assert_same(b, a, "weights, NVMe vs memory")
    rep = opt.memory_report()
    files = os.path.getsize(opt.engine.joined().swapper.path) + os.path.getsize(opt.engine.unit_store.path)
    assert rep.offloaded > 0 and files == rep.offloaded
    assert rep.gradients == 0 and rep.master_weights == 0  # in the swap file between uses
    assert rep.optimizer_states == opt.engine.joined().swapper.pool_bytes


def test_nvme_state_round_trips_through_state_dicts_and_checkpoints(tmp_path):
    ref, ref_opt = _train(2, None)
    os.makedirs(tmp_path / "swap")
    got, opt = _train(2, str(tmp_path / "swap"))
    plain = ref_opt.consolidated_state_dict()
    mine = opt.consolidated_state_dict()
    for i, st in plain["state"].items():
        assert_same(mine["state"][i], st, f"optimizer state of parameter {i}")
    zeroshard.save_checkpoint(str(tmp_path / "ckpt"), 4, model=got, optimizer=opt)
    torch.manual_seed(1)
    fresh = TinyGPT(CFG)
    fopt = zeroshard.ZeroOptimizer(fresh, torch.optim.AdamW, lr=1e-2, stage=2, offload_optimizer="nvme",
                                   nvme_path=str(tmp_path / "swap"))
    zeroshard.load_checkpoint(str(tmp_path / "ckpt"), model=fresh, optimizer=fopt)
    _train(2, None, model=ref, opt=ref_opt, start=4, steps=2)
    _train(2, None, model=fresh, opt=fopt, start=4, steps=2)
    a, b = zeroshard.full_state_dict(ref), zeroshard.full_state_dict(fresh)
    assert_same(b, a, "resumed weights")


def test_missing_path_and_non_adam_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.AdamW, offload_optimizer="nvme",
                                nvme_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="fused kernel"):
        zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.SGD, lr=0.1, offload_optimizer="nvme",
                                nvme_path=str(tmp_path))


def test_truncated_swap_file_fails_the_next_read(tmp_path):
    model, opt = _train(2, str(tmp_path), steps=1)
    os.truncate(opt.engine.joined().swapper.path, 4096)
    model(*synthetic_batch(1, 4, CFG)).backward()
    with pytest.raises(TruncatedFileError, match="zeroshard-optim"):
        opt.step()


def test_small_disk_fails_at_construction_and_full_disk_later_is_harmless():
    d = mount_tmpfs("64k")
    try:
        with pytest.raises(DiskFullError, match="needs .* GiB"):
            zeroshard.ZeroOptimizer(TinyGPT(GPTConfig(vocab=512, d_model=64, n_layers=2, n_heads=4)),
                                    torch.optim.AdamW, offload_optimizer="nvme", nvme_path=d)
        assert not os.listdir(d)  # nothing half-made left behind
    finally:
        subprocess.run(["umount", d])
    d = mount_tmpfs("1m")
    try:
        model, opt = _train(2, d, steps=1)
        with open(os.path.join(d, "filler"), "wb") as f:  # the disk fills up after start-up
            try:
                f.write(b"x" * (2 << 20))
            except OSError:
                pass
        _train(2, None, model=model, opt=opt, start=1, steps=2)  # preallocated: still fine
    finally:
        subprocess.run(["umount", d])


def test_read_only_path():
    d = mount_tmpfs("1m", ro=True)
    try:
        with pytest.raises((PermissionError, AIOError), match="writable"):
            zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.AdamW, offload_optimizer="nvme", nvme_path=d)
    finally:
        subprocess.run(["umount", d])


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_bf16_masters_and_accumulated_gradients_live_in_the_swap_file(stage, tmp_path):
    """Mixed precision: the fp32 master and the gradients (accumulated over micro-batches)
    go to the swap file too; training stays bit-identical to in-memory state."""
    def run(nvme):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, mixed_precision="bf16",
                                      offload_optimizer="nvme" if nvme else None, nvme_path=nvme)
        for step in range(3):
            for k in range(2):
                model(*synthetic_batch(2 * step + k, 4, CFG)).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        return zeroshard.full_state_dict(model), opt
    (a, _), (b, opt) = run(None), run(str(tmp_path))
    assert_same(b, a, "weights, NVMe vs memory")
    rep = opt.memory_report()
    assert rep.master_weights == 0 and rep.gradients == 0 and rep.offloaded > 0


def test_offload_buffer_mb_bounds_the_staging_memory(tmp_path):
    """A cap below one pipeline slot fails at construction and names the slot size; a cap of
    one slot runs without read-ahead, with one pool buffer, and gives the same weights."""
    with pytest.raises(ValueError, match="below one staging slot of .* MiB"):
        zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.AdamW, stage=3, offload_optimizer="nvme",
                                offload_params="nvme", nvme_path=str(tmp_path), offload_buffer_mb=0.01)

    def run(cap):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload_optimizer="nvme",
                                      offload_params="nvme", nvme_path=str(tmp_path), offload_buffer_mb=cap)
        _train(3, None, steps=3, model=model, opt=opt)
        return zeroshard.full_state_dict(model), opt
    full, opt3 = run(None)
    capped, opt1 = run(0.3)  # one slot of this model (~0.2 MiB), not two
    assert opt1.engine.unit_store.max_in_flight == 1 and len(opt1.engine.swapper._pool) == 1
    assert opt1.memory_report().optimizer_states < opt3.memory_report().optimizer_states
    assert_same(capped, full, "weights, one slot vs more")
