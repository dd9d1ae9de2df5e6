"""A rank SIGKILLed after step k: torchrun restarts the workers and they resume from the memory
tiers (no disk read), at the same or a smaller world size, bitwise equal to a disk resume of
step k (issue 45, Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import torch

from zeroshard.testing.launch import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "support", "peer_worker.py")


def launch(nproc: int, out: str, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           WORKER, "--out", out, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def merged(out: str, world: int, prefix: str = "final") -> dict[str, torch.Tensor]:
    """Every (parameter, kind) as one tensor over all ranks' pieces (scalars: rank 0's first piece)."""
    parts: dict[str, list] = {}
    for r in range(world):
        for key, t in torch.load(os.path.join(out, f"{prefix}-{r}.pt")).items():
            name, start, _stop, kind = key.split("|")
            parts.setdefault(f"{name}|{kind}", []).append((int(start), t))
    return {k: torch.cat([t.reshape(-1) for _, t in sorted(v, key=lambda p: p[0])]) if not k.split("|")[1].startswith("scalar")
            else sorted(v, key=lambda p: p[0])[0][1] for k, v in parts.items()}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def resume_info(out: str, rank: int, prefix: str = "resume") -> dict:
    with open(os.path.join(out, f"{prefix}-{rank}.json")) as f:
        return json.load(f)


def tier_path() -> str:
    return f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"


# Each test is one torchrun job: after the run under test, the same processes resume a fresh
# model, optimizer and (empty) tier from the disk checkpoint of the same step and train to the
# end: the reference (--ref-root; ref-*.pt), compared bitwise.

def test_sigkilled_rank_resumes_from_memory_same_world(tmp_path):
    tier, fresh = tier_path(), tier_path()
    try:
        disk, run = str(tmp_path / "disk"), str(tmp_path / "run")
        proc = launch(2, run, "--tier", tier, "--load-root", disk, "--save-root", disk, "--save-at", "3",
                      "--kill-rank", "1", "--kill-at", "3", "--steps", "6", "--stage", "2",
                      "--ref-root", disk, "--ref-tier", fresh, restarts=1)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Signals.SIGKILL" in proc.stderr or "exitcode: -9" in proc.stderr, proc.stderr[-3000:]
        for r in range(2):  # the restarted workers took step 3 from memory and read nothing from disk
            assert resume_info(run, r) == {"step": 3, "source": "memory", "disk_bytes_read": 0, "world_size": 2,
                                           "resharded": False}
        # reference: the disk checkpoint of step 3 resumed at the same world size (no tier to find)
        # (each rank says it twice: in the first attempt, no tier yet, and in the reference)
        assert proc.stdout.count("loading from the disk checkpoint") == 4, proc.stdout[-3000:]
        ref = resume_info(run, 0, "ref-resume")
        assert ref["source"] is None and ref["step"] == 3
        assert ref["disk_bytes_read"] > 0  # (the count sees a disk load)
        assert_bitwise(merged(run, 2), merged(run, 2, "ref-final"))
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)


def test_lost_node_resumes_from_buddy_replicas_at_smaller_world(tmp_path):
    tier, fresh = tier_path(), tier_path()
    try:
        disk, run, rerun = (str(tmp_path / n) for n in ("disk", "run", "rerun"))
        common = ["--steps", "6", "--stage", "3"]
        proc = launch(3, run, "--tier", tier, "--load-root", str(tmp_path / "none"), "--save-root", disk,
                      "--save-at", "3", "--kill-rank", "2", "--kill-at", "3", *common)
        assert proc.returncode != 0 and os.path.isdir(os.path.join(tier, "rank-2", "own"))
        shutil.rmtree(os.path.join(tier, "rank-2"))  # rank 2's node and its memory are gone
        proc = launch(2, rerun, "--tier", tier, "--load-root", str(tmp_path / "none"), *common,
                      "--ref-root", disk, "--ref-tier", fresh)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for r in range(2):
            assert resume_info(rerun, r) == {"step": 3, "source": "memory", "disk_bytes_read": 0, "world_size": 3,
                                             "resharded": True}
        ref = resume_info(rerun, 0, "ref-resume")
        assert ref["step"] == 3 and ref["source"] is None
        assert_bitwise(merged(rerun, 2), merged(rerun, 2, "ref-final"))
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)
