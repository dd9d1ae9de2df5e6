"""zeroshard writes torch Distributed Checkpoints FSDP2 loads with ``dcp.load`` (torchtitan's
layout): every tensor equal to what zeroshard held; a torn save never looks complete."""
from __future__ import annotations

import os

import pytest

import torch

from tests.support import dcp_worker
from zeroshard.checkpoint import dcp_metadata
from tests.support.asserts import assert_same
from tests.support.dist_results import run_ranks

STEPS = 2


def test_fsdp2_loads_what_zeroshard_saved_as_dcp(tmp_path):
    """zeroshard at world 4, stage 3, stage 2 with its optimizer state in NVMe swap files, and
    stage 3 on a (replicate 2 x shard 2) hybrid mesh, saves; FSDP2 at world 2 loads each, and a
    hybrid-mesh optimizer loads the hybrid save; FSDP2 at world 3 loads each too (Note [DCP under hybrid sharding])."""
    (tmp_path / "zs").mkdir()
    (tmp_path / "swap").mkdir()
    runs = [(str(tmp_path / "s3"), 3, None, False), (str(tmp_path / "s2"), 2, str(tmp_path / "swap"), False),
            (str(tmp_path / "hybrid"), 3, None, True)]
    res = run_ranks(dcp_worker.zs_save, 4, tmp_path / "zs", runs, STEPS)
    paths = res[0]["paths"]
    for (root, _, _, _), step_dir in zip(runs, paths):
        assert sorted(os.listdir(root)) == [os.path.basename(step_dir)]  # (no .tmp- left)
        assert {".metadata", "zeroshard-dcp.json"} <= set(os.listdir(step_dir))
        # (sizes and CRC32s summed as torch wrote the files match the files)
        assert dcp_metadata.verify(step_dir, full=True) is None
    saved = torch.load(str(tmp_path / "zs" / "res.pt"), weights_only=True)
    for world in (2, 3):  # (FSDP2's rows split 2 and 3 ways: chunks of zeroshard's 4 ranks read across)
        (tmp_path / f"fsdp{world}").mkdir()
        run_ranks(dcp_worker.fsdp_load, world, tmp_path / f"fsdp{world}", paths)
        for (_, stage, _, hybrid), want, got in zip(runs, saved, torch.load(str(tmp_path / f"fsdp{world}" / "res.pt"),
                                                                             weights_only=True)):
            assert_same(got["loaded"], {k: v.reshape(got["loaded"][k].shape) for k, v in want["saved"].items()},
                        f"FSDP2 at world {world}: the state loaded from zeroshard's stage-{stage} "
                        f"{'hybrid ' * hybrid}DCP checkpoint")
            assert got["lr"] == want["lr"] and got["step"] == STEPS
    # (hybrid: the first replica's shard group wrote each chunk once; a hybrid-mesh optimizer loads it back)
    assert {n for n in os.listdir(paths[2]) if n.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    want = saved[2]["saved"]
    for replica, loaded in enumerate((saved[2]["loaded"], torch.load(str(tmp_path / "zs" / "res.replica1.pt"),
                                                                      weights_only=True))):
        assert_same({k: v.reshape(want[k].shape) for k, v in loaded.items()}, want,
                    f"replica {replica} of a hybrid-mesh ZeroOptimizer loading a hybrid DCP save")


CHUNKS = (1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 18, 21, 24)
POINTS = [("dcp-begin", 1)] + [("dcp-chunk", n) for n in CHUNKS] + [
    ("dcp-file", 1), ("dcp-file", 2), ("dcp-metadata-rename", 1), ("dcp-written", 1), ("dcp-sums", 1),
    ("dcp-rename", 1)]


def test_sigkill_during_a_dcp_save_leaves_the_previous_step_loadable(tmp_path):
    """SIGKILL at 20 points of a DCP save (before, between chunk writes, after each file, at
    .metadata's rename, after .metadata, after the checksum file, at the commit's rename), one
    forked save per point in one spawn: the root still loads the previous step exactly."""
    res = run_ranks(dcp_worker.zs_crash_many, 1, tmp_path, str(tmp_path / "roots"), POINTS)
    report = res[0]["report"]
    assert len(report) == len(POINTS) == 20
    for got in report:
        where = f"SIGKILL at {got['point']} #{got['n']}"
        assert got["killed"] and got["torn"], where  # (the kill hit the save, and left its .tmp-)
        assert got["step"] == 1 and got["path"] == "step-00000001" and got["same"], (where, got)


def test_a_committed_dcp_step_cut_short_is_passed_over(tmp_path):
    """A committed step 2 whose data file was cut short afterwards: step 1 loads."""
    out = tmp_path / "damaged"
    out.mkdir()
    run_ranks(dcp_worker.zs_crash, 1, out, str(out / "root"), "none", 0)
    data = os.path.join(str(out / "root"), "step-00000002", "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 1)
    run_ranks(dcp_worker.zs_load_roots, 1, tmp_path, [str(out / "root")])
    got = torch.load(str(tmp_path / "res.pt"), weights_only=True)[0]
    assert got["step"] == 1 and got["path"].endswith("step-00000001"), got["path"]
    assert_same(got["weights"], torch.load(str(out / "res.expect"), weights_only=True), "weights loaded past a damaged step")


def test_save_format_is_checked_by_name(tmp_path):
    import zeroshard
    with pytest.raises(ValueError, match="format='zip': use 'native'"):
        zeroshard.save_checkpoint(str(tmp_path), 1, model=None, optimizer=None, format="zip")
    with pytest.raises(TypeError, match="saves a ZeroOptimizer's state"):
        zeroshard.save_checkpoint(str(tmp_path), 1, model=None, optimizer=None, format="dcp")


def test_dcp_resume_with_dropout_continues_bitwise(tmp_path):
    """Each rank's RNG states and data position travel in the DCP checkpoint (per-rank JSON
    bytes entries): a run with dropout resumed at world 2 equals the uninterrupted one, from a
    synchronous save, from an asynchronous one the next steps ran over, and from a native save
    `convert-dcp` turned into DCP (every rank's RNG and data position carried over)."""
    res = run_ranks(dcp_worker.zs_rng_resume, 2, tmp_path, str(tmp_path / "root"))
    for kind in ("sync", "async", "converted"):
        got = [r[kind] for r in res]
        assert [g["pos"] for g in got] == [2, 12], kind
        assert all(g["rng_restored"] and not g["resharded"] for g in got), (kind, got)
        assert all(g["same"] and g["draws"] for g in got), (kind, got)
