"""Swap files damaged while training: deleted, truncated, zero-filled, replaced; left by
killed runs of other kinds and world sizes. Damage is an error naming the file, or changes
nothing (a part that is rewritten before it is read); never silent zeros."""
from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import zeroshard
from zeroshard.io import AIOError
from zeroshard.offload.swap_file import remove_stale_swap
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support.asserts import assert_same
from tests.support.models import TINY_GPT

CFG = TINY_GPT
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (stage, offload_params): the moments' file plus the grads file, or (ZeRO-Infinity) the params file.
PLACEMENTS = [(2, None), (3, None), (3, "nvme")]
DAMAGE = ("delete", "truncate", "zero_fill", "replace")


def _make(stage: int, params, precision, nvme):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, mixed_precision=precision,
                                  offload_optimizer="nvme" if nvme else None,
                                  offload_params=params if nvme else None, nvme_path=nvme)
    return model, opt


def _step(model, opt, step: int) -> None:
    model(*synthetic_batch(step, 4, CFG)).backward()
    opt.step()
    opt.zero_grad()


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "delete":
        os.unlink(path)
    elif how == "truncate":
        os.truncate(path, size // 2)
    elif how == "zero_fill":  # same size, same inode: only the bytes are gone
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(size), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    else:  # another file under the same name, of the same size
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(bytes(size))


_reference: dict = {}


def _ref(stage, params, precision) -> dict:
    key = (stage, params, precision)
    if key not in _reference:
        model, opt = _make(stage, params, precision, None)
        for s in range(2):
            _step(model, opt, s)
        _reference[key] = zeroshard.full_state_dict(model)
    return _reference[key]


@pytest.mark.parametrize("precision", (None, "bf16"))
@pytest.mark.parametrize("stage,params", PLACEMENTS)
def test_damaged_swap_file_is_an_error_naming_it(stage, params, precision, tmp_path):
    """Each file of each placement, each damage, after backward (gradients written) and before
    the step that reads the state back: an error naming the file, or the same result."""
    outcomes = []
    for which in ("swapper", "unit_store"):
        for how in DAMAGE:
            nvme = tmp_path / f"{which}-{how}"
            nvme.mkdir()
            model, opt = _make(stage, params, precision, str(nvme))
            _step(model, opt, 0)
            path = getattr(opt.engine.joined(), which).path
            model(*synthetic_batch(1, 4, CFG)).backward()
            opt.engine.reducer.finalize()  # every gradient reduced and written out: all state is on disk
            opt.engine.unit_store.settle()
            _damage(path, how)
            try:
                opt.step()
                opt.zero_grad()
            except AIOError as exc:
                assert path in str(exc) and "\n" not in str(exc), (which, how, str(exc))
                outcomes.append("error")
            else:  # nothing it held was needed again: the result must be exactly the undamaged one
                got, want = zeroshard.full_state_dict(model), _ref(stage, params, precision)
                assert_same(got, want, f"{which} {how}: silent corruption")
                outcomes.append("harmless")
            opt.engine.joined().swapper.close()
            opt.engine.unit_store.close()  # (damaged: closing discards it, and never removes another file)
            assert os.listdir(nvme) == ([os.path.basename(path)] if how == "replace" else [])
    # With every part on disk when the damage happens, every damage is caught.
    assert outcomes.count("error") == len(outcomes), list(zip([(w, h) for w in ("swapper", "unit_store") for h in DAMAGE], outcomes))


def test_a_swap_file_is_never_recreated_after_start_up(tmp_path):
    model, opt = _make(2, None, "bf16", str(tmp_path))
    _step(model, opt, 0)
    os.unlink(opt.engine.unit_store.path)
    with pytest.raises(AIOError, match=re.escape(opt.engine.unit_store.path) + ".*deleted"):
        model(*synthetic_batch(1, 4, CFG)).backward()  # gradients are written as reductions retire
        opt.step()
    assert not os.path.exists(opt.engine.unit_store.path)


def test_stale_files_of_any_kind_rank_or_world_size_are_removed_but_live_ones_kept(tmp_path):
    """A SIGKILLed world-of-4 run's files of every kind go; a live run's (lock held, even under
    a pid this process cannot see) and unrelated files stay."""
    code = ("import os, signal, torch, zeroshard\n"
            "from zeroshard.offload.swap_file import SwapFile\n"
            f"files = [SwapFile({str(tmp_path)!r}, kind, rank) for kind in ('optim', 'grads', 'params') "
            "for rank in range(4)]\n"
            "for f in files: f.reserve(0, 4096, 'x {gib}')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = sorted(os.listdir(tmp_path))
    assert len(dead) == 12
    live = tmp_path / "zeroshard-optim-rank00001-pid999999-0.swap"  # pid not visible: another namespace
    live.write_bytes(b"x")
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    (tmp_path / "notes.swap").write_bytes(b"mine")
    try:
        model, opt = _make(2, None, None, str(tmp_path))
        left = sorted(os.listdir(tmp_path))
        assert not set(dead) & set(left)
        assert live.name in left and "notes.swap" in left
        assert {os.path.basename(opt.engine.joined().swapper.path), os.path.basename(opt.engine.unit_store.path)} <= set(left)
        # A second optimizer of this process must not remove the first one's files.
        model2, opt2 = _make(2, None, None, str(tmp_path))
        assert os.path.exists(opt.engine.joined().swapper.path) and os.path.exists(opt.engine.unit_store.path)
        _step(model, opt, 0)
    finally:
        os.close(holder)
    assert remove_stale_swap(str(tmp_path)) == [str(live)]  # its holder is gone now
