"""A node preempted (SIGTERM) hands its ranks' state to the peers' memory tiers and a rank
SIGKILLed after step k is restarted by torchrun: the workers resume from the memory tiers (no
disk read), at a smaller or the same world size, bitwise equal to a disk resume of that step
(issue 45, Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from typing import Optional

import torch

from zeroshard.resilience import slots
from zeroshard.testing.launch import free_port

from tests.support.peer_worker import merged

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "support", "peer_worker.py")


def launch(nproc: int, out: str, *args: str, restarts: int = 0, kill_at: str = "") -> subprocess.CompletedProcess:
    """``kill_at``: ``ZEROSHARD_TEST_KILL_AT`` (Note [kill points] in zeroshard/testing/kill_points.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ZEROSHARD_TEST_KILL_AT=kill_at)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           WORKER, "--out", out, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def resume_info(out: str, rank: int, prefix: str, attempt: Optional[int] = None) -> dict:
    with open(os.path.join(out, f"{prefix}-{rank}{'' if attempt is None else f'-{attempt}'}.json")) as f:
        return json.load(f)


def tier_path() -> str:
    return f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"


def test_preempted_node_hands_off_then_a_sigkill_at_the_smaller_world_resumes_from_memory(tmp_path):
    """One check per phase, two torchrun jobs (Note [preemption handoff] in
    zeroshard/checkpoint/memory_handoff.py, Note [peer memory tier]):
    A. world 3, stage 2, a commit every 2nd step: ranks 1 and 2 (a node) get a real SIGTERM in
       step 3; the ranks agree on step 3, commit it (forced: not a 2nd step) and hand it over
       (rank 1's buddy, 2, leaves too: rank 1 sends its slot to rank 0); every rank exits 0.
       Then the node's memory is deleted (rank-1, rank-2).
    B. world 2, stage 3, ``--max-restarts 1``: the workers resume step 3 from rank 0's tier
       (resharded 3 -> 2, no disk read though the disk holds step 3), train, and rank 1 is
       SIGKILLed mid-way through the copy of step 6's commit into its own slot (Note [kill
       points] in zeroshard/testing/kill_points.py: after its second tensor; the slot torn is
       the older one, so step 4 stays valid in both copies); the restarted workers resume step 4
       from memory (same world, no disk read: the torn commit is lost, nothing half-applied);
       that recovery is itself killed (rank 0, once its piece exchange is posted: the
       ``recovery`` kill point), and the second restart recovers step 4 again from memory (a
       recovery only reads the tiers) and trains to the end; then, in the same processes, the
       reference: step 3's disk checkpoint resumed at world 2 with a fresh tier and trained as
       far, compared bitwise."""
    tier, fresh = tier_path(), tier_path()
    try:
        disk, run, rerun = (str(tmp_path / n) for n in ("disk", "run", "rerun"))
        proc = launch(3, run, "--tier", tier, "--load-root", str(tmp_path / "none"), "--save-root", disk,
                      "--save-at", "3", "--term-ranks", "1,2", "--term-at", "3", "--every", "2", "--stage", "2")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for r in range(3):  # every rank agreed on step 3 and handed it over
            with open(os.path.join(run, f"handoff-{r}.json")) as f:
                assert json.load(f) == {"step": 3, "handed_off": True, "leaving": [1, 2], "pairs": [[1, 0]]}
            assert not os.path.exists(os.path.join(run, f"final-{r}.safetensors"))  # (it stopped at step 3)
        handed = slots.read_stamp(os.path.join(tier, "rank-0", "replica-1", "slot-0"))
        assert handed is not None and handed["step"] == 3, "rank 1's slot did not reach rank 0 (its buddy left too)"
        for r in (1, 2):  # the preempted node and its memory are gone
            shutil.rmtree(os.path.join(tier, f"rank-{r}"))
        assert sorted(os.listdir(os.path.join(tier, "rank-0"))) == ["own", "replica-1", "replica-2"]
        proc = launch(2, rerun, "--tier", tier, "--load-root", disk, "--every", "2", "--steps", "6", "--stage", "3",
                      "--ref-root", disk, "--ref-tier", fresh, restarts=2, kill_at="replica_copy:6:1:2,recovery:4:0:1:1")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stderr.count("exitcode: -9") == 2, proc.stderr[-3000:]
        for r in range(2):  # (the killed recovery wrote no resume record on either rank)
            assert not os.path.exists(os.path.join(rerun, f"resume-{r}-1.json"))
        for r in range(2):  # no disk read in either attempt (the disk's step 3 is not newer than the tiers')
            assert resume_info(rerun, r, "resume", 0) == {"step": 3, "source": "memory", "disk_bytes_read": 0,
                                                         "world_size": 3, "resharded": True}
            assert resume_info(rerun, r, "resume", 2) == {"step": 4, "source": "memory", "disk_bytes_read": 0,
                                                         "world_size": 2, "resharded": False}
        assert proc.stdout.count("loading from the disk checkpoint") == 2, proc.stdout[-3000:]  # (the reference's)
        ref = resume_info(rerun, 0, "ref-resume")
        assert ref["source"] is None and ref["step"] == 3 and ref["world_size"] == 3
        assert ref["disk_bytes_read"] > 0  # (the count sees a disk load)
        assert_bitwise(merged(rerun, 2), merged(rerun, 2, "ref-final"))
        # World 3's replica (rank 0 kept rank 2's) went once world 2 had committed on every rank
        # (Note [stale slots] in zeroshard/resilience/stale_slots.py); world 2's layout stays.
        assert {r: sorted(os.listdir(os.path.join(tier, r))) for r in os.listdir(tier)} == {
            "rank-0": ["own", "replica-1"], "rank-1": ["own", "replica-0"]}
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)

