"""A 2-rank worker for tests/dist/test_memory_tier_pacing_and_residuals.py, one spawn for the
checks of the memory tier (Note [peer memory tier] in zeroshard/resilience/memory_tier.py):

- ``codec``: int8 gradients with error feedback, 3 steps committed, rank 1's own slot deleted,
  a fresh optimizer recovers step 3 from memory (rank 1's pieces and residuals from rank 0's
  replica) and both continue 3 steps without the tier: the weights must be equal bit for bit;
  then rank 0's replica of rank 1 goes too (both copies: a rank and its buddy lost), and a
  load falls back to the disk's older step 1 with one line naming rank 1's pieces;
- ``slow``: ``every="auto"`` (the default) on a state large against a tiny step: the ranks
  commit the same steps, every K-th with the K they agree on (K > 1), and a recovery (rank 1's
  own slot deleted) gives the state of the last committed step, losing at most K - 1 steps;
- ``cheap``: ``every="auto"`` on a tiny state and a long step: K = 1, every step committed
  once measured (Note [commit pacing] in zeroshard/resilience/commit_pacer.py);
- ``dead_worker`` (a spawn of its own): rank 1 leaves after step 1's commit; rank 0's disk save
  fails at once."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
import warnings

import psutil
import torch
import torch.distributed as dist

import zeroshard
from tests.support.peer_worker import owned_state


def _step(model, opt, rank: int, s: int, width: int, rows: int) -> None:
    g = torch.Generator().manual_seed(1000 * s + rank)
    x = torch.randn(rows, width, generator=g)
    opt.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _drop_own_slot(root: str, rank: int) -> None:
    """Rank 1's own slots are gone (its node's memory): its pieces come from rank 0's replica."""
    dist.barrier()
    if rank == 1:
        shutil.rmtree(os.path.join(root, "rank-1", "own"))
    dist.barrier()


def _codec(rank: int, root: str) -> dict:
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, stage=2, grad_codec="int8", codec_block=32,
                                          grad_error_feedback=True, bucket_size_mb=0.001,
                                          redundancy=zeroshard.PeerRedundancy(path=root, run_id="codec", every=1))
    m1, o1 = build()
    disk = root + "-disk"
    for s in range(3):
        _step(m1, o1, rank, s, 16, 4)
        zeroshard.memory_checkpoint(s + 1, model=m1, optimizer=o1)
        if s == 0:
            zeroshard.save_checkpoint(disk, 1, model=m1, optimizer=o1)
            at_disk = owned_state(m1, o1)
    o1.engine.memory_tier.wait()
    saved = {k: v.clone() for k, v in o1.engine.codecs.residuals.items()}
    _drop_own_slot(root, rank)
    m2, o2 = build()
    info = zeroshard.load_checkpoint(root + "-no-disk", model=m2, optimizer=o2)
    loaded = {k: v.clone() for k, v in o2.engine.codecs.residuals.items()}
    for s in range(3, 6):  # both continue without the tier (one tier directory, two optimizers)
        _step(m1, o1, rank, s, 16, 4)
        _step(m2, o2, rank, s, 16, 4)
    out = {"step": info["step"], "source": info["source"],
           "residuals": sorted(saved), "nonzero": all(bool(v.abs().sum() > 0) for v in saved.values()),
           "restored": sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved),
           "equal": all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))}
    dist.barrier()
    if rank == 0:  # (rank 1's own slots went above: now its buddy's replica of them too)
        shutil.rmtree(os.path.join(root, "rank-0", "replica-1"))
    dist.barrier()
    m3, o3 = build()
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        lost = zeroshard.load_checkpoint(disk, model=m3, optimizer=o3)
    got = owned_state(m3, o3)
    out["both_lost"] = {"step": lost["step"], "said": said.getvalue().strip().splitlines(),
                        "equal": at_disk.keys() == got.keys() and all(torch.equal(at_disk[k], got[k]) for k in got)}
    for o in (o1, o2, o3):
        o.close()
    return out


def _auto(rank: int, root: str, width: int, steps: int, sleep_s: float) -> dict:
    def build(**kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-3, stage=2,
                                          redundancy=zeroshard.PeerRedundancy(path=root, run_id="auto", **kw))
    m, o = build(max_every=8)  # (every: the default, "auto")
    tier = o.engine.memory_tier
    committed, gaps, snapshot = [], [], {}
    for s in range(1, steps + 1):
        _step(m, o, rank, s, width, 1)
        time.sleep(sleep_s)  # (the cheap case's step: long against its commit)
        if zeroshard.memory_checkpoint(s, model=m, optimizer=o):
            committed.append(s)
            gaps.append(tier.pacer.every)  # the gap to the next commit, agreed before this one
            snapshot = owned_state(m, o)
    tier.wait()  # (step 12's commit is done on this rank: its node's memory goes after it, not during it)
    report = tier.report()
    _drop_own_slot(root, rank)
    m2, o2 = build(every=1)
    info = zeroshard.load_checkpoint(root + "-no-disk", model=m2, optimizer=o2)
    got = owned_state(m2, o2)
    out = {"committed": committed, "gaps": gaps, "report": {k: report[k] for k in (
               "every", "decided", "commit_cost", "step_cost", "auto", "budget", "max_every")},
           "recovered": info["step"], "source": info["source"], "steps": steps,
           "equal": snapshot.keys() == got.keys() and all(torch.equal(snapshot[k], got[k]) for k in snapshot)}
    o.close()
    o2.close()
    return out


def parity_full_worker(rank: int, world: int, out_path: str, root: str) -> None:
    """Parity groups of 2: rank 1's tmpfs is full (its own slots write to /dev/full). Both ranks
    must turn the tier off together (the commit's gather), or rank 0's next parity exchange
    waits for a rank that no longer commits (ZEROSHARD_PG_TIMEOUT, 20 s here)."""
    os.environ["ZEROSHARD_PG_TIMEOUT"] = "20"
    if rank == 1:
        for slot in ("slot-0", "slot-1"):
            os.makedirs(os.path.join(root, "rank-1", "own", slot))
            os.symlink("/dev/full", os.path.join(root, "rank-1", "own", slot, "data.bin"))
    dist.barrier()
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    o = zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, stage=2,
                                redundancy=zeroshard.PeerRedundancy(path=root, run_id="full", every=1, parity=2))
    committed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(4):
            _step(m, o, rank, s, 8, 2)
            if zeroshard.memory_checkpoint(s + 1, model=m, optimizer=o):
                committed.append(s + 1)
    out = {"committed": committed, "disabled": o.engine.memory_tier.disabled}
    o.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def dead_worker(rank: int, world: int, out_path: str, root: str) -> None:
    """A spawn of its own: the side group must not exist yet (a save or load made it)."""
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(_dead_before_save(rank, root), f)


def _dead_before_save(rank: int, root: str) -> dict:
    """Rank 1 ends after step 1's commit; rank 0's disk save then fails at once (its side group
    was made at the first commit: Note [save group made early] in memory_commit.py) instead of
    waiting in new_group for rank 1's address until the timeout (30 s here)."""
    os.environ["ZEROSHARD_PG_TIMEOUT"] = "30"
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    o = zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, stage=2,
                                redundancy=zeroshard.PeerRedundancy(path=root, run_id="dead", every=1))
    _step(m, o, rank, 0, 8, 2)
    zeroshard.memory_checkpoint(1, model=m, optimizer=o)
    o.engine.memory_tier.wait()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        return {}  # (this process ends: its sockets close)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        zeroshard.save_checkpoint(root + "-disk", 1, model=m, optimizer=o)
        error = None
    except Exception as exc:  # noqa: BLE001 - what the save raised is the result
        error = f"{type(exc).__name__}: {exc}"[:300]
    return {"seconds": time.monotonic() - t0, "error": error}


def worker(rank: int, world: int, out_path: str, root: str) -> None:
    results = {"codec": _codec(rank, root + "-codec"),
               "slow": _auto(rank, root + "-slow", 1024, 36, 0.0),
               "cheap": _auto(rank, root + "-cheap", 8, 12, 0.5)}
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)
