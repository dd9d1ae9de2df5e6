"""Crash consistency: SIGKILL at many points inside save_checkpoint; the newest committed
step always loads exactly, and the next save cleans up and commits."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import zeroshard
from tests.support.ckpt_crash_child import build, params_hex, train_step

# (point, occurrence, step that loads): `latest` is the commit point, so step 1 until it
# names step 2 (a renamed step 2 is complete and loads when asked for explicitly).
POINTS = [
    ("begin", 1, 1),
    ("before_data", 1, 1),
    ("data_chunk", 1, 1),       # the data file holds only its header
    ("after_data", 1, 1),       # data written, RNG file and manifest not
    ("before_rename", 1, 1),    # manifest fsynced in the temporary directory
    ("after_rename", 1, 1),     # step 2 complete, `latest` still names step 1
    ("after_latest", 1, 2),
    ("rotate", 1, 2),           # keep_last=1 is deleting step 1
]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The children, two at a time (they are independent; two cores): {point: (root, expect
    path, process)}."""
    from tests.support.ckpt_crash_child import main
    from zeroshard.testing.launch import start_process
    base = tmp_path_factory.mktemp("crash")
    runs = {}
    for k, (point, occurrence, _) in enumerate(POINTS):
        if k >= 2:
            runs[POINTS[k - 2][0]][2].join(300)
        root, expect = str(base / point / "ckpt"), str(base / point / "expect.json")
        os.makedirs(base / point)
        # (a process like the ranks': forked from the preloaded server under the test suite)
        runs[point] = (root, expect, start_process(main, root, point, occurrence, expect))
    for _, _, proc in runs.values():
        proc.join(300)
    return runs


@pytest.mark.parametrize("point,occurrence,survivor", POINTS, ids=[p[0] for p in POINTS])
def test_sigkill_inside_save(killed, point, occurrence, survivor):
    root, expect_path, proc = killed[point]
    assert proc.exitcode == -signal.SIGKILL, f"child was not killed at {point}: exit {proc.exitcode} (its stderr is above)"
    expect = json.load(open(expect_path))
    assert zeroshard.latest_checkpoint(root) is not None
    model, opt = build(seed=5)
    info = zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    assert info["step"] == survivor, info
    assert params_hex(model) == expect[str(survivor)]
    # Training goes on and the next save commits, removing what the crash left behind.
    train_step(model, opt, 3)
    zeroshard.save_checkpoint(root, 3, model=model, optimizer=opt)
    assert sorted(n for n in os.listdir(root) if ".tmp-" in n or ".trash-" in n) == []
    assert zeroshard.latest_checkpoint(root).endswith("step-00000003")


def test_sigkill_while_writing_large_file(tmp_path):
    """Killed mid-file with several chunks written (a 40 MB parameter)."""
    root = str(tmp_path / "ckpt")
    code = f"""
import os, signal, torch, zeroshard
from zeroshard.checkpoint import commit, shard_file
shard_file._CHUNK = 1 << 20
model = torch.nn.Linear(2500, 4000)
opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=0, lr=0.1)
zeroshard.save_checkpoint({root!r}, 1, model=model, optimizer=opt)
n = [0]
def hook(name):
    n[0] += name == "data_chunk"
    if n[0] == 30:
        os.kill(os.getpid(), signal.SIGKILL)
commit.fault_hook = hook
with torch.no_grad():
    model.weight.add_(1.0)
zeroshard.save_checkpoint({root!r}, 2, model=model, optimizer=opt)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tmp = [n for n in os.listdir(root) if ".tmp-" in n]
    assert tmp and os.path.getsize(os.path.join(root, tmp[0], "rank-00000.safetensors")) > 4 << 20
    model = torch.nn.Linear(2500, 4000)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=0, lr=0.1)
    assert zeroshard.load_checkpoint(root, model=model, optimizer=opt)["step"] == 1
    assert model.weight.abs().max().item() < 1.0  # step 1's weights, not the +1.0 of step 2
