"""Survivors of a SIGKILLed rank keep their processes: they re-form the process group at world 2
through a store the test hosts (as torchrun's agent hosts its store), rebuild the optimizer and
recover from the memory tiers, with no disk read, and end bitwise equal to a disk resume of the
recovered step at world 2 (issue 45 item 4; Note [in-process recovery] in
zeroshard/train/in_process.py)."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest
import torch.distributed as dist

from tests.dist.test_peer_recovery import assert_bitwise, merged
from tests.support.in_process_worker import worker
from zeroshard.testing.launch import start_process

KILL_STEP, STEPS = 5, 7


@pytest.mark.parametrize("kill_member,stage,stop", [(1, 2, False), (0, 3, False), (2, 2, True)],
                         ids=["kill-rank1-stage2", "kill-rank0-stage3", "stop-rank2-stage2"])
def test_survivors_reform_the_group_and_recover_from_memory_in_their_processes(tmp_path, kill_member, stage, stop):
    """3 members; ``kill_member`` SIGKILLs itself in step 5 (after its optimizer step, before the
    commit), or is SIGSTOPped before step 5 (the others' collective times out after 4 s, its
    heartbeat stops). Rank 0's loss included: the store is the test's, not a worker's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tier = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    out = str(tmp_path)
    procs = [start_process(worker, m, 3, store.port, out, tier, stage, kill_member, KILL_STEP, STEPS, stop)
             for m in range(3)]
    try:
        deadline = time.monotonic() + 120
        for m, p in enumerate(procs):
            if m != kill_member:
                p.join(max(1.0, deadline - time.monotonic()))
        if stop:  # (the survivors are done: the stopped member is ended here)
            procs[kill_member].kill()
        procs[kill_member].join(max(1.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [(-9 if m == kill_member else 0) for m in range(3)], codes
        survivors = [m for m in range(3) if m != kill_member]
        results = []
        for m in survivors:
            with open(os.path.join(out, f"result-{m}.json")) as f:
                results.append(json.load(f))
        for m, r in zip(survivors, results):
            assert r["pid"] == procs[m].pid  # (the same process trained on)
            assert r["rank"] == survivors.index(m) and r["world"] == 2
            assert len(r["recoveries"]) == 1, r["recoveries"]
            got = r["recoveries"][0]
            assert got["lost"] == [kill_member] and got["world_size"] == 2 and got["source"] == "memory", got
            # the step in flight is lost, and the one before where its commit had not finished everywhere
            assert got["step"] in ((KILL_STEP - 1,) if stop else (KILL_STEP - 2, KILL_STEP - 1)), got
            if not stop:  # (its death seen in the process table, not after the 5 s heartbeat staleness)
                assert got["agree_s"] < 4.0, got
            assert r["disk_bytes_read"] == 0  # (the checkpoint root holds step 2, older: not opened)
            assert r["ref_source"] is None and r["ref_step"] == got["step"]
        assert results[0]["recoveries"][0]["step"] == results[1]["recoveries"][0]["step"]
        assert_bitwise(merged(out, 2), merged(out, 2, "ref-final"))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(tier + "-ref", ignore_errors=True)
