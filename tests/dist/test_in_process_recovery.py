"""Survivors of a SIGKILLed rank keep their processes: they re-form the process group at world 2
through a store the test hosts (as torchrun's agent hosts its store), rebuild the optimizer and
recover from the memory tiers, with no disk read, and end bitwise equal to a disk resume of the
recovered step at world 2 (issue 45 item 4; Note [in-process recovery] in
zeroshard/train/in_process.py). Also: a second loss inside the recovery (a second round), and
the store's host lost with a worker (``RecoveryFailed`` naming the store, the tiers intact)."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest
import torch.distributed as dist

from tests.dist.test_peer_recovery import assert_bitwise
from tests.support.peer_worker import merged
from tests.support.in_process_worker import host_store, worker
from zeroshard.resilience import tier_report
from zeroshard.testing.launch import start_process

KILL_STEP, STEPS = 5, 7


def _results(out: str, members: list[int]) -> list[dict]:
    results = []
    for m in members:
        with open(os.path.join(out, f"result-{m}.json")) as f:
            results.append(json.load(f))
    return results


def _assert_recovered_like_the_disk_save(out: str, results: list[dict]) -> None:
    """No disk read, the same recovered step everywhere, bitwise equal to its disk save resumed at 2."""
    for r in results:
        got = r["recoveries"][-1]
        assert r["disk_bytes_read"] == 0  # (the checkpoint root holds step 2, older: not opened)
        assert r["saved_after"] is True
        assert r["ref_source"] is None and r["ref_step"] == got["step"]
    assert len({r["recoveries"][-1]["step"] for r in results}) == 1, results
    assert_bitwise(merged(out, 2), merged(out, 2, "ref-final"))


def _end(procs: list, tier: str) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    shutil.rmtree(tier, ignore_errors=True)
    shutil.rmtree(tier + "-ref", ignore_errors=True)


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
        results = _results(out, survivors)
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
        _assert_recovered_like_the_disk_save(out, results)
    finally:
        _end(procs, tier)


def test_a_loss_during_the_recovery_starts_a_second_round_from_memory(tmp_path):
    """4 members at stage 2: member 1 SIGKILLs itself in step 5; member 2 SIGKILLs itself inside
    the survivors' recovery (the ``recovery`` kill point: its piece exchange posted, nothing
    applied). Members 0 and 3 run a second round in the same processes, recover the same step
    from the memory tiers (no disk read) and end bitwise equal to its disk save resumed at 2."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tier = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    out = str(tmp_path)
    procs = [start_process(worker, m, 4, store.port, out, tier, 2, 1, KILL_STEP, STEPS, False, 2)
             for m in range(4)]
    try:
        deadline = time.monotonic() + 150
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0, -9, -9, 0], codes
        results = _results(out, [0, 3])
        for i, (m, r) in enumerate(zip((0, 3), results)):
            assert r["pid"] == procs[m].pid and r["rank"] == i and r["world"] == 2
            assert len(r["recoveries"]) == 1, r["recoveries"]  # (the first round did not complete)
            got = r["recoveries"][0]
            assert got["generation"] == 2 and got["lost"] == [1, 2] and got["rounds"] == 2, got
            assert got["world_size"] == 2 and got["source"] == "memory", got
            assert got["step"] in (KILL_STEP - 2, KILL_STEP - 1), got
        _assert_recovered_like_the_disk_save(out, results)
    finally:
        _end(procs, tier)


def test_losing_the_store_host_ends_the_survivors_promptly_with_the_tiers_intact(tmp_path):
    """3 members; the store runs in a process of its own, and member 1 SIGKILLs it just before
    itself in step 5. The survivors cannot agree: each ends with ``RecoveryFailed`` naming the
    store within twice the timeout (4 s), exits non-zero, and the memory tiers still hold a
    complete, valid step a torchrun restart would recover from."""
    timeout_s = 4.0
    out = str(tmp_path)
    port_file = os.path.join(out, "store-port")
    host = start_process(host_store, port_file)
    tier = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    procs = []
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert host.is_alive() and time.monotonic() < deadline, "the store's process did not start"
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        procs = [start_process(worker, m, 3, port, out, tier, 2, 1, KILL_STEP, STEPS, False, -1, host.pid, timeout_s)
                 for m in range(3)]
        deadline = time.monotonic() + 120
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        host.join(1.0)
        assert host.exitcode == -9 and [p.exitcode for p in procs] == [3, -9, 3], [p.exitcode for p in procs]
        with open(os.path.join(out, "killed-at")) as f:
            killed_at = float(f.read())
        for m in (0, 2):
            with open(os.path.join(out, f"failed-{m}.json")) as f:
                failed = json.load(f)
            assert f"store at 127.0.0.1:{port}" in failed["error"], failed
            assert failed["at"] - killed_at < 2 * timeout_s, (failed["at"] - killed_at, failed)
            assert failed["recoveries"] == []
        report = tier_report.describe(tier)
        assert report["slots"] and all(s["valid"] for s in report["slots"]), report["slots"]
        complete = [s["step"] for s in report["steps"] if s["complete"] and s["world_size"] == 3]
        assert complete and max(complete) >= KILL_STEP - 2, report["steps"]
    finally:
        _end([*procs, host], tier)
