"""Kernel discovery, status reporting and the pure-PyTorch fallback of zeroshard.ops."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import zeroshard.ops
from zeroshard.ops import kernel_status
from zeroshard.ops._loader import build_lock

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: list[str] | str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
    args = [sys.executable, *code] if isinstance(code, list) else [sys.executable, "-c", code]
    return subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=300)


def test_kernel_status_describes_both_kernels() -> None:
    status = kernel_status()
    for name in ("cpu_adam", "cuda_adam"):
        assert set(status[name]) >= {"active", "source", "reason"}
        assert status[name]["reason"]
    if status["cpu_adam"]["active"]:
        assert status["cpu_adam"]["isa"] in status["cpu_adam"]["supported_isas"]
    import torch

    if torch.version.cuda is None:
        assert not status["cuda_adam"]["active"] and "CPU-only" in status["cuda_adam"]["reason"]


def test_python_m_reports_kernels() -> None:
    proc = _run(["-m", "zeroshard.ops"])
    assert proc.returncode == 0, proc.stderr
    assert "cpu_adam" in proc.stdout and "cuda_adam" in proc.stdout and "fallback" in proc.stdout
    if kernel_status()["cpu_adam"]["active"]:
        assert "isa=" in proc.stdout


def test_fallback_warns_once_and_stays_exact() -> None:
    code = """
import warnings, torch
from zeroshard.ops import adam_step_, reference_adam_step_, kernel_status
kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, grad_scale=0.5)
p, m, v = torch.randn(100), torch.zeros(100), torch.zeros(100)
q, mq, vq = p.clone(), m.clone(), v.clone()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in (1, 2, 3):
        g = torch.randn(100).bfloat16()
        out = torch.empty(100, dtype=torch.bfloat16)
        adam_step_(p, g, m, v, step=step, out_lowp=out, **kw)
        reference_adam_step_(q, g, mq, vq, step=step, **kw)
assert torch.equal(p, q) and torch.equal(out, q.bfloat16()), "fallback differs from reference"
msgs = [str(w.message) for w in caught if "zeroshard.ops" in str(w.message)]
assert len(msgs) == 1, msgs
assert "ZEROSHARD_DISABLE_KERNELS" in msgs[0], msgs[0]
assert not kernel_status()["cpu_adam"]["active"]
print("OK")
"""
    proc = _run(code, ZEROSHARD_DISABLE_KERNELS="1")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_isa_cap_from_environment() -> None:
    if not kernel_status()["cpu_adam"]["active"]:
        pytest.skip("CPU kernel not built here")
    proc = _run("from zeroshard.ops import kernel_status; print(kernel_status()['cpu_adam']['isa'])",
                ZEROSHARD_CPU_ISA="scalar")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "scalar"


def test_build_lock_clears_stale_baton_and_serialises(tmp_path: pytest.TempPathFactory) -> None:
    build_dir = str(tmp_path / "ext")
    os.makedirs(build_dir)
    with open(os.path.join(build_dir, "lock"), "w"):
        pass  # the baton a builder killed mid-build leaves behind
    events: list[str] = []

    def second() -> None:
        with build_lock(build_dir):
            events.append("second")

    with build_lock(build_dir):
        assert not os.path.exists(os.path.join(build_dir, "lock"))
        worker = threading.Thread(target=second)
        worker.start()
        time.sleep(0.3)
        events.append("first-done")
    worker.join(timeout=30)
    assert events == ["first-done", "second"]


def test_public_names() -> None:
    for name in ("FusedAdam", "adam_step_", "kernel_status"):
        assert hasattr(zeroshard.ops, name)
