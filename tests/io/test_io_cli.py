"""``zeroshard bench aio`` and ``python -m zeroshard.io`` end to end, on small real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroshard import cli
from zeroshard.io.bench import Point, recommend


def test_bench_aio_measures_and_recommends(tmp_path, capsys):
    rc = cli.main(["bench", "aio", "--path", str(tmp_path), "--size", "4M", "--block-sizes", "256K,1M",
                   "--queue-depths", "2,4", "--backend", "python", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["points"]) == 4
    assert all(p["write_gbps"] > 0 and p["read_gbps"] > 0 for p in out["points"])
    assert out["recommended"] in out["points"]
    assert os.listdir(tmp_path) == []  # the measurement file is removed


def test_bench_aio_text_output_and_bad_path(tmp_path, capsys):
    assert cli.main(["bench", "aio", "--path", str(tmp_path), "--size", "1M", "--block-sizes", "1M",
                     "--queue-depths", "2"]) == 0
    assert "recommended: AsyncIO(block_size=1048576, queue_depth=2)" in capsys.readouterr().out
    assert cli.main(["bench", "aio", "--path", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "aio", "--path", str(tmp_path), "--size", "lots"])


def test_recommend_prefers_the_smallest_config_near_the_best():
    pts = [Point("native", 1 << 20, 4, 1.0, 1.0), Point("native", 8 << 20, 4, 3.0, 2.5),
           Point("native", 8 << 20, 16, 3.05, 2.55), Point("native", 16 << 20, 32, 3.1, 2.6)]
    best = recommend(pts)
    assert (best.block_size, best.queue_depth) == (8 << 20, 4)
    skewed = [Point("python", 1 << 20, 4, 3.0, 1.0), Point("python", 8 << 20, 4, 1.0, 3.0),
              Point("python", 4 << 20, 8, 2.5, 2.5)]
    assert recommend(skewed).block_size == 4 << 20  # no point near both bests: best harmonic mean
    with pytest.raises(ValueError):
        recommend([])


def test_python_m_zeroshard_io_prints_status(capsys):
    from zeroshard.io.__main__ import main

    assert main() == 0
    out = capsys.readouterr().out
    assert out.startswith("backend    ") and "fallback" in out and "O_DIRECT" in out


def test_disabled_native_engine_falls_back_and_says_why(tmp_path):
    """One fresh process (the loader decides once per process) with the kernels disabled."""
    path = str(tmp_path / "f.bin")
    code = ("import torch, zeroshard.io as z; from zeroshard.io.__main__ import main; main();"
            "io = z.AsyncIO(); t = z.aligned_empty(5000, torch.float32).fill_(3);"
            f"io.pwrite(t, {path!r}).wait(); u = z.aligned_empty(5000, torch.float32);"
            f"io.pread(u, {path!r}).wait(); print('RESULT', io.backend, bool((u == 3).all()))")
    env = dict(os.environ, ZEROSHARD_DISABLE_KERNELS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env=env).stdout
    assert "backend    python" in out and "ZEROSHARD_DISABLE_KERNELS=1" in out
    assert out.split("RESULT")[1].split() == ["python", "True"]
