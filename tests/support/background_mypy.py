"""mypy over zeroshard/ started once, right after collection, beside the other tests.

Note [mypy in the background]: the type check (tests/unit/test_structure.py) is the longest single
test of the suite (~48 s on CI's 2 cores, most of it reading torch's sources), yet most of the
suite's wall time is spent waiting on spawned ranks and rendezvous, not computing. So when the
session selected that test, tests/conftest.py starts mypy at low priority as soon as collection
ends, and the test only collects its verdict (or runs it in the foreground when nothing was
started: a test selected on its own). Same command, same configuration: only the start moves.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO, Optional

MYPY_TEST = "tests/unit/test_structure.py::test_mypy_finds_no_type_errors"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    workdir: tempfile.TemporaryDirectory[str]


_running: Optional[_Running] = None


def _command(cache_dir: str) -> list[str]:
    return [sys.executable, "-m", "mypy", "--config-file", os.path.join(".ci", "mypy.ini"), "--cache-dir", cache_dir,
            "zeroshard"]


def start() -> None:
    """Starts the check once (niced: it fills the time the tests wait on other processes)."""
    global _running
    if _running is not None:
        return
    workdir = tempfile.TemporaryDirectory(prefix="zeroshard-mypy-")
    out = open(os.path.join(workdir.name, "out.txt"), "w+b")  # (a file, not a pipe: nothing reads until the test)
    proc = subprocess.Popen(_command(os.path.join(workdir.name, "cache")), cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10))
    _running = _Running(proc, out, workdir)


def result(timeout_s: float = 900.0) -> tuple[int, str]:
    """mypy's exit status and output: the background run's if one was started, else a run now."""
    global _running
    running, _running = _running, None
    if running is None:
        with tempfile.TemporaryDirectory(prefix="zeroshard-mypy-") as d:
            proc = subprocess.run(_command(d), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
            return proc.returncode, proc.stdout[-6000:] + proc.stderr[-2000:]
    try:
        code = running.proc.wait(timeout=timeout_s)
        running.out.seek(0)
        return code, running.out.read().decode(errors="replace")[-8000:]
    finally:
        running.out.close()
        running.workdir.cleanup()


def stop() -> None:
    """Ends a run nobody collected (the session stopped early: -x, an interrupt)."""
    global _running
    running, _running = _running, None
    if running is not None:
        running.proc.kill()
        running.proc.wait()
        running.out.close()
        running.workdir.cleanup()
