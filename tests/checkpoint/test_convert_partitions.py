"""``zeroshard convert-deepspeed`` checks each partition against what DeepSpeed records about it,
bounds what it reads, and names the field and the file it refuses (issue 43, section 2).
Checkpoints are written by the real DeepSpeed on 2 ranks (tests/support/ds_convert_worker.py)."""
from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import zeroshard
from tests.support import ds_convert_worker as worker
from zeroshard.cli import main
from zeroshard.deepspeed_compat.convert import convert_deepspeed
from zeroshard.deepspeed_compat.restricted_unpickler import load_pt
from zeroshard.testing.launch import spawn

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    out = str(tmp_path_factory.mktemp("ds_convert"))
    spawn(worker.run, 2, out, threads=1)
    return out


def _copy(ds: str, name: str, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(ds, name), dst)
    return os.path.join(dst, worker.TAG)


def _convert(src: str, tmp_path, capsys) -> tuple[int, str]:
    rc = main(["convert-deepspeed", src, str(tmp_path / "zs")])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("stage", worker.STAGES)
def test_a_rank_file_replaced_by_a_copy_of_rank_0s_is_refused(ds, tmp_path, capsys, stage):
    src = _copy(ds, f"stage{stage}", tmp_path)
    assert _convert(src, tmp_path / "ok", capsys)[0] == 0  # (as written, it converts)
    shutil.copy(os.path.join(src, OPTIM.format(0)), os.path.join(src, OPTIM.format(1)))
    rc, err = _convert(src, tmp_path, capsys)
    assert rc == 1 and OPTIM.format(1) in err, err
    assert ("not rank 1's" if stage == 2 else "a copy of rank 0's") in err, err
    assert not os.path.exists(tmp_path / "zs" / "step-00000002")


def test_swapped_rank_files_are_refused_as_out_of_place(ds, tmp_path, capsys):
    src = _copy(ds, "stage2", tmp_path)
    a, b = (os.path.join(src, OPTIM.format(r)) for r in (0, 1))
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    rc, err = _convert(src, tmp_path, capsys)
    assert rc == 1 and f"{OPTIM.format(0)}: its partition of group 0 is not rank 0's" in err, err


def test_a_memo_bomb_in_the_client_state_is_refused_quickly(ds, tmp_path):
    src = os.path.join(ds, "bomb")
    size = os.path.getsize(os.path.join(src, worker.TAG, "mp_rank_00_model_states.pt"))
    code = (f"from zeroshard.cli import main; raise SystemExit(main(['convert-deepspeed', {src!r}, "
            f"{str(tmp_path / 'zs')!r}]))")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "memo bomb" in done.stderr and "mp_rank_00_model_states.pt" in done.stderr, \
        done.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and size < 1 << 20


def _recompress(path: str) -> None:
    """The storage records deflated (the pickle left as torch.save stores it)."""
    with zipfile.ZipFile(path) as zf:
        records = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, raw in records:
            zf.writestr(name, raw, compress_type=zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED)


def test_compressed_records_are_refused_before_they_are_read(ds, tmp_path, capsys):
    src = _copy(ds, "stage2", tmp_path)
    _recompress(os.path.join(src, OPTIM.format(1)))  # (the same bytes, deflated)
    rc, err = _convert(src, tmp_path, capsys)
    assert rc == 1 and OPTIM.format(1) in err and "compressed" in err, err
    # A storage record of 256 MiB deflated into a file of a few hundred KiB: refused unread.
    buf = io.BytesIO()
    torch.save({"optimizer_state_dict": {"x": torch.zeros(64 << 20)}}, buf)
    bomb = str(tmp_path / "inflating.pt")
    with open(bomb, "wb") as f:
        f.write(buf.getvalue())
    del buf
    _recompress(bomb)
    assert os.path.getsize(bomb) < 1 << 20
    with pytest.raises(ValueError, match=r"inflating\.pt: record .*data/0 is compressed"):
        load_pt(bomb)


def test_fields_are_named_with_their_file(ds, tmp_path, capsys):
    rc, err = _convert(os.path.join(ds, "float-steps"), tmp_path, capsys)
    assert rc == 1 and "mp_rank_00_model_states.pt: global_steps=2.5 is not a non-negative integer" in err, err
    rc, err = _convert(os.path.join(ds, "no-zero-stage"), tmp_path / "b", capsys)
    assert rc == 1 and f"{OPTIM.format(1)}: its optimizer_state_dict has no 'zero_stage' field" in err, err


def test_untouched_checkpoints_convert_and_load(ds, tmp_path):
    for stage in worker.STAGES:
        path = convert_deepspeed(os.path.join(ds, f"stage{stage}"), str(tmp_path / f"zs{stage}"))
        model = worker.make_model()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-3)
        info = zeroshard.load_checkpoint(path, model=model, optimizer=opt)
        assert info["step"] == 2 and info["extra"]["client_state"]["note"] == "kept"
