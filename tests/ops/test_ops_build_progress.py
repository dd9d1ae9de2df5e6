"""Progress lines of a just-in-time kernel build (Note [build progress] in zeroshard/ops/_loader.py)."""
from __future__ import annotations

import os
import time

import pytest

from zeroshard.ops import _loader
from zeroshard.ops._build_spec import CPU_ADAM


def test_a_long_build_prints_a_line_at_least_every_interval(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(_loader, "_QUIET_FOR_S", 0.05)
    monkeypatch.setattr(_loader, "_PROGRESS_EVERY_S", 0.2)
    build_dir = str(tmp_path / "build")
    os.makedirs(build_dir)
    with _loader._BuildProgress(CPU_ADAM, build_dir) as progress:
        time.sleep(0.35)  # waiting for another process's build
        progress.waiting = False
        open(os.path.join(build_dir, "adam_scalar.o"), "w").close()
        time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    n = len(CPU_ADAM.sources)  # (the Adam module's sources, the int8 codec's among them)
    assert lines[0].startswith(f"zeroshard: kernel zeroshard_cpu_adam: compiling {n} files") and build_dir in lines[0]
    assert any("waiting for another process" in line for line in lines), lines
    assert any(f"1/{n} files compiled" in line for line in lines), lines
    assert lines[-1].startswith("zeroshard: kernel zeroshard_cpu_adam: ready after"), lines
    assert len(lines) >= 5, lines


def test_a_cache_hit_prints_nothing_and_a_failure_says_so(monkeypatch, tmp_path, capsys) -> None:
    with _loader._BuildProgress(CPU_ADAM, str(tmp_path)):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(_loader, "_QUIET_FOR_S", 0.01)
    with pytest.raises(RuntimeError, match="compiler"):
        with _loader._BuildProgress(CPU_ADAM, str(tmp_path)):
            time.sleep(0.1)
            raise RuntimeError("no compiler")
    assert "failed after" in capsys.readouterr().err.splitlines()[-1]
