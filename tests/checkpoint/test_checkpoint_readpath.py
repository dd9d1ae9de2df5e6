"""The load's read path: each data file is read once, in long runs, so every piece is a view
of a verified buffer (no stitched copies), and damage found late still loads nothing."""
from __future__ import annotations

import os

import torch

import zeroshard
from zeroshard.checkpoint import CheckpointCorruptError, shard_file
from zeroshard.checkpoint.load import _Source, read_phase
from zeroshard.checkpoint import locate

from tests.support.asserts import assert_same


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in (3000, 5000, 7001)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=0, lr=1e-3)
    sum(p.sum() for p in model).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_pieces_are_views_of_one_read(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file, "BLOCK", 4096)  # many blocks, pieces straddling them
    model, opt = _build()
    root = str(tmp_path / "ck")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    step = os.path.join(root, "step-00000001")
    body = locate.check_step(step)
    src = _Source(step, body)
    read_phase(src, model, opt)
    (fname,) = [f for f in body["files"] if f.endswith(".safetensors")]
    reader = src.reader(fname)
    bufs = {id(b) for b, _ in reader._buffers.values()}
    assert len(bufs) == 1, f"the file was read as {len(bufs)} buffers, expected one run"
    # block 0 was read (and verified) for the header, then taken into the run, not read again
    assert reader.bytes_read == body["files"][fname]["bytes"] - 4096, "a block was read twice or not at all"
    for name, pieces in src.pieces.items():
        for p in pieces:
            for key in p["keys"].values():
                t = reader.get(key, 0, p["stop"] - p["start"])
                base = next(iter(reader._buffers.values()))[0]
                assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), \
                    f"{key} was stitched into a copy instead of viewed"
    src.release(defer=True)
    assert not reader._buffers


def test_damage_in_the_last_block_loads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file, "BLOCK", 4096)
    model, opt = _build()
    root = str(tmp_path / "ck")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    path = os.path.join(root, "step-00000001", "rank-00000.safetensors")
    with open(path, "r+b") as f:  # the last byte: every other block verifies first
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    fresh, fresh_opt = _build(seed=5)
    before = [p.detach().clone() for p in fresh]
    try:
        zeroshard.load_checkpoint(os.path.join(root, "step-00000001"), model=fresh, optimizer=fresh_opt)
    except CheckpointCorruptError as exc:
        assert "checksum mismatch" in str(exc)
    else:
        raise AssertionError("a damaged checkpoint loaded")
    assert_same(before, fresh, "a refused checkpoint changed the model")


def test_damage_in_the_last_rank_file_leaves_every_rank_untouched(tmp_path):
    """Stage 2 at world 2: rank 1 finds damage in its file's last byte, after rank 0 verified
    all of its own; neither rank changes or replaces a live tensor (the adopted views come
    in only after every rank verified), and the repaired step loads bit for bit."""
    from tests.support import ckpt_worker
    from tests.support.dist_results import run_ranks
    results = run_ranks(ckpt_worker.damaged_peer, 2, tmp_path, str(tmp_path / "ck"))
    for rank, res in enumerate(results):
        assert res["refused"] is not None and "checksum mismatch" in res["refused"], (rank, res["refused"])
        assert res["untouched"], f"rank {rank}: a refused load changed or replaced live tensors"
        assert res["restored"], f"rank {rank}: the repaired step did not load bit for bit"
        assert res["adopted"] == res["moments"] > 0, f"rank {rank}: moments were copied, not adopted: {res}"


def test_adopted_state_trains_on_bit_for_bit(tmp_path, monkeypatch):
    """Moments taken as views of the verified buffer (across many checksum blocks) are the
    saved values, and training on from them equals training on from the saved run."""
    monkeypatch.setattr(shard_file, "BLOCK", 4096)
    model, opt = _build()
    root = str(tmp_path / "ck")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    saved = {k: v.clone() for k, v in opt.inner.state[opt.engine.joined().runs[0].tensor].items()}
    fresh, fresh_opt = _build(seed=5)
    live = {id(v) for s in fresh_opt.inner.state.values() for v in s.values()}
    zeroshard.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    for run, mine in zip(opt.engine.joined().runs, fresh_opt.engine.runs):
        for key in ("exp_avg", "exp_avg_sq"):
            got = fresh_opt.inner.state[mine.tensor][key]
            assert id(got) not in live, f"{key} was copied into the live tensor, not adopted"
            assert got.untyped_storage().nbytes() == got.nbytes, "memory reports would count the whole buffer"
            assert torch.equal(got, opt.inner.state[run.tensor][key])
    for m, o in ((model, opt), (fresh, fresh_opt)):
        for _ in range(2):
            sum((p * p).sum() for p in m).backward()
            o.step()
            o.zero_grad()
    assert_same(fresh, model, "loaded vs trained")
    # A second load replaces the adopted (and since updated) views by new ones.
    zeroshard.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert_same(saved, fresh_opt.inner.state[fresh_opt.engine.runs[0].tensor], "optimizer state after a second load")


def test_pages_outside_adopted_views_are_given_back():
    """``release`` returns the pages of a read buffer that no adopted view covers (they read
    as zero afterwards: MADV_DONTNEED), and leaves the viewed bytes intact."""
    if shard_file._LIBC is None:
        import pytest
        pytest.skip("madvise is Linux-only")
    page = shard_file._PAGE
    buf = shard_file.aligned_empty(64 * page)
    buf.fill_(7)
    view = buf[20 * page + 3:40 * page + 5]
    shard_file._give_back_outside(buf, [(20 * page + 3, 40 * page + 5)])
    assert int(buf[:20 * page].sum()) == 0 and int(buf[41 * page:].sum()) == 0
    assert bool((view == 7).all()) and int(buf[20 * page]) == 7 and int(buf[40 * page + 5]) == 7
