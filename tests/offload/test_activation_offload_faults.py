"""Activation offload's bad input and faults: options refused with the fix; an activation file
damaged or missing at backward names the block and abandons only that step; a full NVMe
directory during forward says so and leaves no file behind."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import zeroshard
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same
from tests.support.io_helpers import small_filesystem

CFG = replace(w.CFG, dropout=0.0)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(offload_activations="gpu"), ValueError, "use 'cpu'.*or 'nvme'"),
    (dict(offload_activations="nvme"), ValueError, "needs nvme_path"),
    (dict(offload_activations=zeroshard.ActivationOffload.__name__), ValueError, "not a place for activations"),
    (dict(offload_activations=3), TypeError, "must be None, 'cpu', 'nvme'"),
    (dict(offload_activations=zeroshard.ActivationOffload(where="cpu", blocks=("Nope",))), ValueError,
     "matches no module of TinyGPT; its module classes are .*'Block'"),
])
def test_refused_with_the_fix(kwargs, error, match):
    model = TinyGPT(CFG)
    with pytest.raises(error, match=match):
        zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, **kwargs)
    zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1).close()  # (nothing was left attached)


def test_options_refused_in_the_dataclass():
    with pytest.raises(ValueError, match="prefetch=0.*int >= 1"):
        zeroshard.ActivationOffload(where="cpu", prefetch=0)
    with pytest.raises(ValueError, match="path=.*only used with where='nvme'"):
        zeroshard.ActivationOffload(where="cpu", path="/tmp")
    with pytest.raises(TypeError, match="blocks=.*class names or module names"):
        zeroshard.ActivationOffload(where="cpu", blocks=(1,))
    assert zeroshard.ActivationOffload(where="cpu", blocks="Block").blocks == ("Block",)


def _build(path: str, stage: int = 2, ckpt: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(replace(CFG, activation_checkpointing=ckpt))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, nvme_path=path,
                                  offload_activations=zeroshard.ActivationOffload(where="nvme", min_bytes=0))
    return model, opt


def _step(model, opt, step: int, batch: int = 4) -> None:
    model(*synthetic_batch(step, batch, model.config)).backward()
    opt.step()
    opt.zero_grad()


def test_damaged_file_at_backward_names_the_block_and_loses_nothing(tmp_path):
    ref, ref_opt = _build(str(tmp_path / "ref"))
    for step in range(3):
        _step(ref, ref_opt, step)
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt.close()
    for damage, says in (("flipped", "checksum"), ("missing", "does not exist"),
                         ("truncated", "past the end|short|truncat")):
        model, opt = _build(str(tmp_path / damage))
        _step(model, opt, 0)
        _step(model, opt, 1)
        loss = model(*synthetic_batch(2, 4, CFG))
        directory = opt.engine.activations.directory
        victim = os.path.join(directory, sorted(os.listdir(directory))[0])  # the first block's input (not prefetched)
        if damage == "missing":
            os.unlink(victim)
        elif damage == "truncated":
            os.truncate(victim, 100)
        else:
            with open(victim, "r+b") as f:
                f.seek(40)
                byte = f.read(1)
                f.seek(40)
                f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(RuntimeError, match=r"block 'blocks.0'.*could not be read back.*(" + says + ")"):
            loss.backward()
        del loss
        assert os.listdir(directory) == [], damage  # the abandoned backward's files are gone at once
        opt.zero_grad()
        _step(model, opt, 2)  # the step runs again as after an interrupted backward
        assert_same(dict(model.named_parameters()), want, f"weights after the step again ({damage})")
        opt.close()


def test_full_nvme_directory_during_forward(tmp_path):
    with small_filesystem(str(tmp_path), size_mb=1) as mnt:
        model, opt = _build(mnt, ckpt=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match=r"writing block 'blocks\.\d'.*No space left on device.*abandoned"):
            model(*synthetic_batch(0, 64, CFG))  # a few MiB of saved tensors into 1 MiB
        assert os.listdir(opt.engine.activations.directory) == []  # nothing half-written stays
        assert_same(dict(model.named_parameters()), before, "weights")
        _step(model, opt, 0, batch=2)  # a batch that fits trains on
        opt.close()


def test_sigint_in_backward_loses_nothing(tmp_path):
    """A KeyboardInterrupt (SIGINT) while backward brings a block back: the backward is abandoned,
    its activation files go, and after zero_grad() the step runs again like an undisturbed run."""
    ref, ref_opt = _build(str(tmp_path / "ref"))
    for step in range(3):
        _step(ref, ref_opt, step)
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt.close()
    model, opt = _build(str(tmp_path / "run"))
    _step(model, opt, 0)
    _step(model, opt, 1)
    a = opt.engine.activations
    io_of, calls = a._io_of, []

    def interrupted(record):  # (the first record backward brings back: the prefetch's wait is interrupted)
        calls.append(record.block)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return io_of(record)
    loss = model(*synthetic_batch(2, 4, CFG))
    a._io_of = interrupted  # (after the forward, whose end starts the last blocks' prefetch)
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    assert os.listdir(a.directory) == []  # the abandoned backward's files are gone at once, the graph still held
    del loss
    a._io_of = io_of
    opt.zero_grad()
    _step(model, opt, 2)
    assert_same(dict(model.named_parameters()), want, "weights after the interrupted step, run again")
    opt.close()
