"""``PeerRedundancy(parity=g)`` against lost ranks, one torchrun job (issue 45, Note [parity
memory tier] in zeroshard/resilience/parity.py, Note [preemption handoff] in
zeroshard/checkpoint/memory_handoff.py): a lost group falls back to the disk, a
preempted node hands off, and the smaller world rebuilds the rest from the parity, reads no
disk, holds exactly what was handed off, and leaves no rebuilt slot on tmpfs."""
from __future__ import annotations

import json
import os
import shutil

from zeroshard.resilience import parity, tier_report
from tests.dist.test_peer_recovery import assert_bitwise, launch, merged, resume_info, tier_path


def test_parity_a_lost_group_uses_the_disk_a_preempted_node_hands_off_and_the_smaller_world_reads_no_disk(
        tmp_path):
    """One torchrun job, world 4, parity 2 (groups [0, 1], [2, 3]), stage 2:
    A. step 3 is saved to disk and committed, every rank dumps its owned pieces and the tier's
       report, ranks 2 and 3's tier directories are deleted (a whole group) and a fresh model,
       optimizer and tier resume: from the disk, with one log line naming what is gone, equal
       to what was lost.
    B. ranks 1, 2 and 3 (a node) get a real SIGTERM in step 5: the ranks agree on step 5; group
       [0, 1] loses one member (nothing sent: its parity covers it), group [2, 3] both (each
       pushes its slot to rank 0); they dump their pieces, delete their tier directories (the
       node's memory) and exit 0.
    C. rank 0 goes on as a new job of world 1 in the same process (a fresh process group,
       model, optimizer and tier: what a restart at the smaller world does): it resumes step 5
       from its own tier alone (rank 1 rebuilt from rank 0's parity, 2 and 3 from the pushed
       slots; resharded 4 -> 1; no disk read), equal bitwise to what was handed off; the rebuilt
       slot is removed once loaded; it trains a step, whose commit removes world 4's slots;
       ``zeroshard inspect`` sees it covered."""
    tier = tier_path()
    try:
        disk, run = str(tmp_path / "disk"), str(tmp_path / "run")
        proc = launch(4, run, "--tier", tier, "--load-root", disk, "--save-root", disk, "--save-at", "3",
                      "--kill-at", "3", "--lose", "2,3", "--parity", "2", "--term-ranks", "1,2,3", "--term-at", "5",
                      "--steps", "6", "--shrink")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        line = "loading from the disk checkpoint, not the memory tiers: step 3: rank 2's slot is gone and no parity " \
               "slot of its group survives"
        assert proc.stdout.count(line) == 4, proc.stdout[-3000:]
        for r in range(4):
            info = resume_info(run, r, "resume", 1)
            assert info["source"] is None and info["step"] == 3 and info["disk_bytes_read"] > 0
            with open(os.path.join(run, f"handoff-{r}.json")) as f:
                assert json.load(f) == {"step": 5, "handed_off": True, "leaving": [1, 2, 3], "pairs": [[2, 0], [3, 0]]}
        assert_bitwise(merged(run, 4, "resumed"), merged(run, 4, "at-kill"))
        reports = [resume_info(run, r, "tier") for r in range(4)]
        for r, rep in enumerate(reports):  # (two slots each: double-buffered) counted = its group's C, 1/(g - 1) of the longest
            chunk = parity.chunk_bytes(max(reports[m]["shard_bytes"] for m in parity.group_of(r, 4, 2)) // 2, 2)
            assert rep["parity"] == 2 and rep["parity_bytes"] == 2 * chunk, rep
        assert resume_info(run, 0, "resume", "smaller") == {"step": 5, "source": "memory", "disk_bytes_read": 0,
                                                            "world_size": 4, "resharded": True}
        assert_bitwise(merged(run, 1, "smaller-resumed"), merged(run, 4, "handoff"))
        assert sorted(os.listdir(tier)) == ["rank-0"]
        # rank 1's slot was rebuilt (by rank 1 % 1) as rank-0/replica-1 and removed once loaded; the pushed ones
        # (replica-2, -3) and world 4's parity went once world 1 had committed (Note [stale slots])
        assert sorted(os.listdir(os.path.join(tier, "rank-0"))) == ["own"]
        view = tier_report.describe(tier)
        assert {(s["copy"], s["valid"]) for s in view["slots"]} == {("own", True)}
        assert (6, [0], True) in [(st["step"], st["owners"], st["complete"]) for st in view["steps"]]
    finally:
        shutil.rmtree(tier, ignore_errors=True)
