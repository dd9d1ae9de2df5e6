"""Resume is a contract: SIGKILL after a checkpoint, resume, end bit-identical (stages 0-2,
world size 2, shuffled ResumableSampler, dropout); and reshard 4/stage 2 -> 2/stage 3, 2/stage 1,
1/stage 0 against an unsharded reference."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support import ckpt_worker
from tests.support.asserts import assert_same
from zeroshard.testing.launch import spawn

STAGES = [0, 1, 2, 3]
SAVE_AT, TOTAL = 7, 12  # the save is mid-epoch (5 steps per epoch) and training crosses epochs


def _read(out: str, world: int) -> list[dict]:
    return [json.load(open(f"{out}.rank{r}")) for r in range(world)]


def test_bitwise_resume_after_sigkill(tmp_path):
    root = str(tmp_path / "ckpt")
    spawn(ckpt_worker.uninterrupted, 2, STAGES, TOTAL, str(tmp_path / "ref"))
    with pytest.raises(RuntimeError, match="exit codes"):  # every rank SIGKILLs itself
        spawn(ckpt_worker.train_then_kill, 2, STAGES, SAVE_AT, root, 2)
    spawn(ckpt_worker.resume, 2, STAGES, TOTAL, root, str(tmp_path / "res"))
    for rank, (ref, got) in enumerate(zip(_read(str(tmp_path / "ref"), 2), _read(str(tmp_path / "res"), 2))):
        for stage in map(str, STAGES):
            assert got[stage]["step"] == TOTAL
            assert got[stage]["losses"] == ref[stage]["losses"], f"rank {rank} stage {stage}: losses differ"
            bad = [n for n, v in ref[stage]["params"].items() if got[stage]["params"][n] != v]
            assert not bad, f"rank {rank} stage {stage}: parameters differ bitwise: {bad}"


def _params(res: dict) -> dict[str, torch.Tensor]:
    return {n: torch.frombuffer(bytearray.fromhex(h), dtype=torch.float32) for n, h in res["params"].items()}


@pytest.fixture(scope="module")
def world4_checkpoint(tmp_path_factory):
    """A checkpoint saved by 4 ranks at stage 2, and an unsharded reference run."""
    base = tmp_path_factory.mktemp("reshard")
    spawn(ckpt_worker.reshard_save, 4, 2, SAVE_AT, str(base / "ckpt"), str(base / "saved"))
    ckpt_worker.reference(0, 1, TOTAL, str(base / "ref"))  # one process: no spawn needed
    return base


@pytest.mark.parametrize("world,stage", [(2, 3), (2, 1), (1, 0)])
def test_reshard_from_world4_stage2(tmp_path_factory, world4_checkpoint, world, stage):
    base = world4_checkpoint
    root = base / "ckpt"
    out = tmp_path_factory.mktemp("res")
    spawn(ckpt_worker.reshard_resume, world, stage, TOTAL, str(root), str(out / "r"))
    ref = _params(_read(str(base / "ref"), 1)[0])
    for rank, res in enumerate(_read(str(out / "r"), world)):
        assert res["step"] == TOTAL
        got = _params(res)
        # Reduction order differs across world sizes (sums of 4, 2 or 1 partial gradients),
        # so the match is to float rounding, as in test_parity.
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        assert diff <= 1e-6, f"rank {rank}: max |diff| {diff} against the unsharded reference"
        # Each rank reads what its pieces need: at stages 1-3 about 1/world of the data.
        total = sum(f.stat().st_size for f in next(root.glob("step-*")).glob("rank-*.safetensors"))
        if stage > 0:
            assert res["bytes_read"] < total * 0.75, f"rank {rank} read {res['bytes_read']} of {total} bytes"


def test_export_stitches_pieces_of_four_ranks(tmp_path_factory, world4_checkpoint):
    """export_hf of the world-4 / stage-2 checkpoint equals the parameters at the save."""
    from safetensors.torch import load_file

    import zeroshard
    base = world4_checkpoint
    out = tmp_path_factory.mktemp("hf")
    zeroshard.export_hf(str(base / "ckpt"), str(out), max_shard_size="1KB")
    got = {}
    for f in out.iterdir():
        if f.suffix == ".safetensors":
            got.update(load_file(str(f)))
    saved = _params(_read(str(base / "saved"), 4)[0])
    assert sorted(got) == sorted(saved)
    assert_same({n: got[n].reshape(-1) for n in saved}, saved, "resumed weights")
