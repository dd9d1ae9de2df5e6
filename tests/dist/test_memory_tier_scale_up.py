"""Scale up from memory (issue 45, Note [peer memory tier] in zeroshard/resilience/memory_tier.py):
a rank that joins a run (world 2 -> 3) holds nothing in any tier and receives only its own
partition from the old ranks' tiers; the grown run's state equals a disk resume at world 3."""
from __future__ import annotations

import shutil
import uuid

from tests.support import scale_up_worker as sw
from tests.support.dist_results import run_ranks


def test_a_rank_that_joins_receives_only_its_partition_from_the_peers(tmp_path):
    root = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    try:
        for d in ("train", "grow"):
            (tmp_path / d).mkdir()
        run_ranks(sw.train, 2, tmp_path / "train", root, str(tmp_path / "disk"))
        res = run_ranks(sw.grow, 3, tmp_path / "grow", root, str(tmp_path / "disk"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in res:
        assert (r["step"], r["source"], r["world_size"], r["resharded"]) == (3, "memory", 2, True), r
        assert r["equal"] and r["params_equal"], r
    newcomer = res[2]
    # Every byte of its partition came over the process group (it has no slot), and nothing more.
    assert newcomer["bytes_received"] == newcomer["owned_bytes"] > 0, newcomer
