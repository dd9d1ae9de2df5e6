"""The load's read path: each data file is read once, in long runs, so every piece is a view
of a verified buffer (no stitched copies), and damage found late still loads nothing."""
from __future__ import annotations

import os

import torch

import zeroshard
from zeroshard.checkpoint import CheckpointCorruptError, shard_file
from zeroshard.checkpoint.load import _Source, read_phase
from zeroshard.checkpoint import locate


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
    assert all(torch.equal(a, b) for a, b in zip(fresh, before)), "a refused checkpoint changed the model"
