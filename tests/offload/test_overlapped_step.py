"""Note [overlapped step]: at stage 3 with the optimizer state streamed from NVMe, step()
returns while the units are updated in the background, and everything that needs them waits."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import zeroshard
from tests.support.dist_results import run_ranks
from tests.support.nvme_params_worker import AUTO_CFG, make, make_auto, run_overlap
from tests.support.asserts import assert_same
from zeroshard.io import TruncatedFileError
from zeroshard.testing.toy import synthetic_batch


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"ov{request.param}")
    return run_ranks(run_overlap, request.param, d, str(d))


@pytest.mark.parametrize("mp", [None, "bf16"])
def test_overlapped_step_is_bit_identical(results, mp):
    for r in results:
        assert r[f"{mp}-sync"] and r[f"{mp}-overlap"] and r[f"{mp}-checkpoint"], r
        assert r[f"{mp}-overlap-in_flight"] == [True] * 4 and not any(r[f"{mp}-sync-in_flight"]), r


def _gated(opt) -> threading.Event:
    """Holds the background step back until the returned event is set."""
    gate, run = threading.Event(), opt.engine.swapper.run

    def held(*args, **kwargs):
        if not gate.wait(30):
            raise AssertionError("the test never opened the gate")
        return run(*args, **kwargs)
    opt.engine.swapper.run = held
    return gate


def _one_step(model, opt, step: int = 0) -> float:
    loss = model(*synthetic_batch(step, 2, AUTO_CFG))
    loss.backward()
    opt.clip_grad_norm_(0.5)
    opt.step()
    return loss.item()


def test_step_returns_before_the_units_update_and_a_gather_waits(tmp_path):
    ref, ref_opt = make(str(tmp_path), cfg=AUTO_CFG, overlap_step=False)
    model, opt = make(str(tmp_path), cfg=AUTO_CFG, overlap_step=True)
    _one_step(ref, ref_opt)
    _one_step(model, opt)
    opt.finish_step()
    gate = _gated(opt)
    _one_step(ref, ref_opt, 1)
    t0 = time.perf_counter()
    _one_step(model, opt, 1)
    assert time.perf_counter() - t0 < 20 and opt.engine.inflight.running and not gate.is_set()
    opened = threading.Timer(0.3, gate.set)
    opened.start()
    t0 = time.perf_counter()
    with torch.no_grad():  # the first gather waits for its unit
        got = model(*synthetic_batch(7, 2, AUTO_CFG))
    assert time.perf_counter() - t0 >= 0.25
    with torch.no_grad():
        want = ref(*synthetic_batch(7, 2, AUTO_CFG))
    assert torch.equal(got, want)
    opt.close()
    ref_opt.close()


def _second_step_held(ref: tuple, got: tuple) -> tuple:
    """Two steps of both; ``got``'s second is held back in the background for 0.3 s."""
    for m, o in (ref, got):
        _one_step(m, o)
        o.zero_grad()
    gate = _gated(got[1])
    for m, o in (ref, got):
        _one_step(m, o, 1)
    threading.Timer(0.3, gate.set).start()
    return ref, got


def test_checkpoint_and_state_dict_wait_for_the_step(tmp_path):
    (ref, ref_opt), (model, opt) = _second_step_held(make(str(tmp_path), cfg=AUTO_CFG, overlap_step=False),
                                                     make(str(tmp_path), cfg=AUTO_CFG, overlap_step=True))
    zeroshard.save_checkpoint(str(tmp_path / "ck"), 2, model=model, optimizer=opt)  # waits
    assert not opt.engine.inflight.running
    want, got = ref_opt.consolidated_state_dict(to_rank=None), opt.consolidated_state_dict(to_rank=None)
    assert_same([list(s.values()) for s in got["state"].values()], [list(s.values()) for s in want["state"].values()],
                "optimizer state")
    m2, o2 = make(str(tmp_path), cfg=AUTO_CFG, seed=9)
    zeroshard.load_checkpoint(str(tmp_path / "ck"), model=m2, optimizer=o2)
    a, b = zeroshard.full_state_dict(ref), zeroshard.full_state_dict(m2)
    assert_same(b, a, "resumed weights")
    for o in (opt, ref_opt, o2):
        o.close()


def test_torch_save_of_model_state_dict_waits_for_the_step(tmp_path):
    """Stage 3's model.state_dict() holds sharded parameters over the units' shards: reading
    them (torch.save) right after step() must see the new weights, not half of them."""
    import io
    (ref, ref_opt), (model, opt) = _second_step_held(  # (shards in memory)
        make(None, cfg=AUTO_CFG), make(str(tmp_path), cfg=AUTO_CFG, overlap_step=True, params=None))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # waits for each unit as it reads it
    buf.seek(0)
    got = torch.load(buf, weights_only=True)  # (one rank: plain tensors, Note [saving pieces])
    want = zeroshard.full_state_dict(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    opt.close()
    ref_opt.close()


def test_an_error_of_the_background_step_is_raised_by_the_next_call(tmp_path):
    model, opt = make(str(tmp_path), cfg=AUTO_CFG, overlap_step=True)
    _one_step(model, opt)
    opt.zero_grad()
    model(*synthetic_batch(1, 2, AUTO_CFG)).backward()
    gate = _gated(opt)
    opt.step()  # returns: the damage is met in the background
    os.truncate(opt.engine.swapper.path, 4096)
    gate.set()
    with pytest.raises(TruncatedFileError, match="zeroshard-optim"):
        model(*synthetic_batch(2, 2, AUTO_CFG))
    assert not opt.engine.inflight.running  # (raised once, by the call that waited)


def test_auto_placement_overlaps_by_default_and_explicit_options_do_not(tmp_path):
    from zeroshard.planner.auto_placement import PlacementError
    with pytest.raises(PlacementError) as exc:
        make_auto(str(tmp_path), 0)
    model, opt = make_auto(str(tmp_path), exc.value.minimum["host"])
    _one_step(model, opt)
    assert opt.engine.swapper is not None and opt.engine.inflight.running
    opt.close()
    model, opt = make(str(tmp_path), cfg=AUTO_CFG)
    _one_step(model, opt)
    assert not opt.engine.inflight.running
    opt.close()


def test_overlap_step_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="overlap_step='yes' must be True or False"):
        make(str(tmp_path), cfg=AUTO_CFG, overlap_step="yes")


def test_an_urgent_read_has_its_own_engine_and_the_same_checks(tmp_path):
    from zeroshard.io import aligned_empty
    from zeroshard.offload.swap_file import SwapFile
    f = SwapFile(str(tmp_path), "params", 0)
    try:
        f.reserve(0, 1 << 20, "{gib}")
        data = aligned_empty(1 << 18, torch.float32)
        data.copy_(torch.arange(1 << 18, dtype=torch.float32))
        f.pwrite(data, 0).wait()
        back = aligned_empty(1 << 18, torch.float32)
        f.pread(back, 0, urgent=True).wait()
        assert torch.equal(back, data) and f._urgent is not None and f._urgent is not f.aio
        assert f.bytes_read == f.bytes_written == 1 << 20
        os.truncate(f.path, 4096)  # the same guard as any read
        with pytest.raises(TruncatedFileError):
            f.pread(back, 0, urgent=True).wait()
    finally:
        f.close()


class _Skips(torch.nn.Module):
    """Three blocks; ``forward(x, skip)`` leaves block ``skip`` out (no gradient for its unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16)) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: int) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x.pow(2).mean()


def test_a_unit_without_gradient_after_an_overlapped_step_matches_the_synchronous_step(tmp_path):
    """zero_grad() with a step in flight marks the stores empty once the step is joined: a unit
    the next pass never reaches keeps no stale gradient (the same bits as a synchronous step)."""
    def build(overlap: bool, sub: str):
        torch.manual_seed(0)
        model = _Skips()
        os.makedirs(tmp_path / sub)
        return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=3,
                                              stage3_unit_classes=["Sequential"], offload_optimizer="nvme",
                                              offload_params="nvme", nvme_path=str(tmp_path / sub),
                                              overlap_step=overlap)
    runs = [build(False, "sync"), build(True, "overlap")]
    for step, skip in enumerate((-1, 1, 1, -1, 2, 0)):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m, o in runs:
            m(x, skip).backward()
            o.step()
            o.zero_grad()
    want, got = (zeroshard.full_state_dict(m) for m, _ in runs)
    assert_same(got, want, "weights")
    for _, o in runs:
        o.close()
