"""Damage and attacks get clear errors and load nothing wrong."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import zlib

import pytest
import torch

import zeroshard
from tests.support.ckpt_crash_child import build, params_hex, train_step
from zeroshard.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointMismatchError


@pytest.fixture
def ckpt(tmp_path):
    """A root with steps 1 and 2 of TinyNet; returns (root, {step: params hex})."""
    root = str(tmp_path / "ckpt")
    model, opt = build()
    expect = {}
    for step in (1, 2):
        train_step(model, opt, step)
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt)
        expect[step] = params_hex(model)
    return root, expect


def _step(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _data(root: str, step: int) -> str:
    return os.path.join(_step(root, step), "rank-00000.safetensors")


def _load_step(path: str):
    model, opt = build(seed=9)
    before = params_hex(model)
    return model, opt, before


def _rewrite_manifest(step_dir: str, edit) -> None:
    """What an attacker can do: edit the manifest and recompute its checksum."""
    path = os.path.join(step_dir, "manifest.json")
    outer = json.load(open(path))
    edit(outer["manifest"])
    canon = json.dumps(outer["manifest"], sort_keys=True, separators=(",", ":")).encode()
    outer["crc32"] = zlib.crc32(canon)
    json.dump(outer, open(path, "w"))


def _expect_refused(step_dir: str, match: str, exc=CheckpointCorruptError) -> None:
    model, opt, before = _load_step(step_dir)
    with pytest.raises(exc, match=match):
        zeroshard.load_checkpoint(step_dir, model=model, optimizer=opt)
    assert params_hex(model) == before, "a refused checkpoint changed the model"


def test_flipped_byte_falls_back(ckpt):
    root, expect = ckpt
    path = _data(root, 2)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(path, "wb").write(raw)
    _expect_refused(_step(root, 2), "checksum mismatch")
    model, opt, _ = _load_step(root)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000002"):
        info = zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    assert info["step"] == 1 and "checksum" in info["skipped"][0][1]
    assert params_hex(model) == expect[1]
    assert zeroshard.latest_checkpoint(root, verify=True).endswith("step-00000001")


def test_truncated_shard(ckpt):
    root, _ = ckpt
    path = _data(root, 2)
    os.truncate(path, os.path.getsize(path) - 100)
    _expect_refused(_step(root, 2), "truncated")
    assert zeroshard.latest_checkpoint(root).endswith("step-00000001")


def test_missing_shard(ckpt):
    root, _ = ckpt
    os.unlink(_data(root, 2))
    _expect_refused(_step(root, 2), "missing")


def test_damaged_manifest(ckpt):
    root, _ = ckpt
    path = os.path.join(_step(root, 2), "manifest.json")
    raw = open(path).read()
    open(path, "w").write(raw.replace('"step": 2', '"step": 3', 1))
    _expect_refused(_step(root, 2), "checksum mismatch")


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "sub/rank-00000.safetensors", ".."])
def test_manifest_paths_are_never_followed(ckpt, bad):
    root, _ = ckpt

    def edit(body):
        body["files"][bad] = body["files"].pop("rank-00000.safetensors")
        for meta in body["tensors"].values():
            for p in meta["pieces"]:
                p["file"] = bad
    _rewrite_manifest(_step(root, 2), edit)
    _expect_refused(_step(root, 2), "never followed")


def test_manifest_absurd_sizes(ckpt):
    root, _ = ckpt
    _rewrite_manifest(_step(root, 2), lambda b: b["tensors"]["fc1.weight"].update(shape=[1 << 40, 1 << 40]))
    _expect_refused(_step(root, 2), "outside")
    _rewrite_manifest(_step(root, 1), lambda b: b["files"]["rank-00000.safetensors"].update(bytes=1 << 45))
    _expect_refused(_step(root, 1), "checksums for|manifest says")


def test_manifest_piece_pointing_past_the_data(ckpt):
    root, _ = ckpt

    def edit(body):
        p = body["tensors"]["fc1.weight"]["pieces"][0]
        p["keys"]["param"] = body["tensors"]["gain"]["pieces"][0]["keys"]["param"]  # a 1-element entry
    _rewrite_manifest(_step(root, 2), edit)
    _expect_refused(_step(root, 2), "wrong size|is stored under")


def test_different_model_lists_mismatches(ckpt):
    root, _ = ckpt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(15, 9), torch.nn.Linear(9, 3))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2)
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: \['0.bias', '0.weight'"):
        zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    from tests.support.models import TinyNet
    wide = TinyNet()
    wide.fc1 = torch.nn.Linear(15, 8)
    wide.norm = torch.nn.LayerNorm(8)
    wide.fc2, wide.head = torch.nn.Linear(8, 1), torch.nn.Linear(8, 32)
    opt = zeroshard.ZeroOptimizer(wide, torch.optim.AdamW, stage=1, lr=1e-2)
    with pytest.raises(CheckpointMismatchError, match=r"fc1.weight: checkpoint \[7, 15\] vs model \[8, 15\]"):
        zeroshard.load_checkpoint(root, model=wide, optimizer=opt)


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def test_full_disk_during_save(tmp_path):
    root = str(tmp_path / "disk")
    if not _mount_tmpfs(root, "1M"):
        pytest.skip("needs root and tmpfs to simulate a full disk")
    try:
        model, opt = build()
        train_step(model, opt, 1)
        zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
        saved = params_hex(model)
        free = shutil.disk_usage(root).free
        with open(os.path.join(root, "filler"), "wb") as f:  # leave too little for another step
            f.write(b"\0" * max(0, free - 20_000))
        train_step(model, opt, 2)
        with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint is intact"):
            zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)
        assert sorted(os.listdir(root)) == ["filler", "latest", "step-00000001"]
        train_step(model, opt, 3)  # training goes on
        os.unlink(os.path.join(root, "filler"))
        zeroshard.save_checkpoint(root, 3, model=model, optimizer=opt)
        fresh, fresh_opt = build(seed=3)
        assert zeroshard.load_checkpoint(os.path.join(root, "step-00000001"), model=fresh,
                                         optimizer=fresh_opt)["step"] == 1
        assert params_hex(fresh) == saved
    finally:
        subprocess.run(["umount", root], capture_output=True)
