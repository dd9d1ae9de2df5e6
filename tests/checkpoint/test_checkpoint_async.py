"""Asynchronous saves: staged while training goes on, same commit, errors on the next call."""
from __future__ import annotations

import os

import pytest

import zeroshard
from tests.support.ckpt_crash_child import build, params_hex, train_step
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.saver import _SAVER


def test_async_save_captures_the_call_instant(tmp_path):
    root = str(tmp_path / "ckpt")
    model, opt = build()
    train_step(model, opt, 1)
    at_save = params_hex(model)
    handle = zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt, async_save=True)
    for step in (2, 3):  # optimizer.step waits for staging, then training goes on
        train_step(model, opt, step)
    assert params_hex(model) != at_save
    assert handle.wait().endswith("step-00000001")
    fresh, fresh_opt = build(seed=4)
    zeroshard.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert params_hex(fresh) == at_save


def test_one_in_flight_and_staging_reused(tmp_path):
    root = str(tmp_path / "ckpt")
    model, opt = build()
    train_step(model, opt, 1)
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt, async_save=True)
    first = {k: v.data_ptr() for k, v in _SAVER._buffers.items()}
    train_step(model, opt, 2)
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt, async_save=True)  # waits for step 1
    zeroshard.wait_checkpoint()
    assert {k: v.data_ptr() for k, v in _SAVER._buffers.items()} == first
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000001", "step-00000002"]


def test_async_error_surfaces_on_next_call(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the root should be")
    model, opt = build()
    train_step(model, opt, 1)
    zeroshard.save_checkpoint(str(blocker), 1, model=model, optimizer=opt, async_save=True)
    train_step(model, opt, 2)
    with pytest.raises(CheckpointError, match="previous asynchronous checkpoint save failed"):
        zeroshard.save_checkpoint(str(tmp_path / "ok"), 2, model=model, optimizer=opt)
    zeroshard.save_checkpoint(str(tmp_path / "ok"), 2, model=model, optimizer=opt)  # reported once
