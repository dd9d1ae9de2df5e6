"""The newcomer's first minutes (issue 39, section 2): ``bash .ci/run`` after the README's demo
installs nothing that is already there and reuses the kernel the demo built; the quick tier's
list is checked by every run that collects its files; the demos say what they show and leave
no temporary folder behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_ci_installs_nothing_when_the_venv_has_everything():
    """This environment runs the tests, so it has torch and the test extras; .ci/run's check
    says so (and pip is skipped); a torch pin it lacks is named."""
    check = os.path.join(ROOT, ".ci", "installed.py")
    import torch
    have = torch.__version__.split("+")[0]
    ok = subprocess.run([sys.executable, check, have], capture_output=True, text=True, env=ENV, timeout=120)
    if ok.returncode and "zeroshard from" in ok.stderr:
        pytest.skip(f"this environment imports another checkout's zeroshard: {ok.stderr.strip()}")
    assert ok.returncode == 0, ok.stderr
    other = subprocess.run([sys.executable, check, "0.0.1"], capture_output=True, text=True, env=ENV, timeout=120)
    assert other.returncode == 1 and "torch==0.0.1" in other.stderr
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        run = f.read()
    assert "python .ci/installed.py" in run and "pip install -q" not in run  # (no silent minutes)


def test_a_cached_kernel_loads_without_running_the_build_tool(tmp_path):
    """After one build (the demo's, or this session's), a new process loads the kernel from the
    cache without ninja: a `ninja` that fails stands first on PATH, and nothing may call it
    (Note [reusing a cached build])."""
    from zeroshard.ops._loader import REGISTRY
    if REGISTRY.cpu().source != "jit":
        pytest.skip(f"the CPU kernel is not a just-in-time build here ({REGISTRY.cpu().reason})")
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "ninja-ran"
    (fake / "ninja").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    code = ("from zeroshard.ops._loader import REGISTRY; s = REGISTRY.cpu(); "
            "print(s.source, s.module is not None, s.reason)")
    env = {**ENV, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.startswith("jit True"), (out.stdout, out.stderr[-2000:])
    assert not marker.exists() and "compiling" not in out.stderr


def test_every_run_checks_the_quick_tier_entries_of_the_files_it_collects(tmp_path):
    """A renamed test breaks the next run that collects its file, not only `--quick`; a file
    collected in part (a node id on the command line) is not judged."""
    tier = tmp_path / "tier.txt"
    tier.write_text("tests/ops/test_sqnorm.py::test_that_was_renamed\ntests/unit/test_api.py::test_also_renamed\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/ops/test_sqnorm.py", "tests/unit/test_api.py::test_is_a_torch_optimizer_with_the_users_param_groups"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**ENV, "ZEROSHARD_QUICK_TIER": str(tier)})
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "test_that_was_renamed" in said and "test_also_renamed" not in said, said[-3000:]


def test_demo_says_what_its_figures_are():
    from zeroshard.demo import stages_and_resume as demo
    text = demo.header(862_000, 2, 12, 8)
    assert "Ψ = 862,000 parameters" in text and "N = 2 ranks" in text
    assert "master 0.00 MiB" in text and "fp32 master" in text
    intro = demo.RESUME_INTRO.format(root="/tmp/x")
    assert "separate run" in intro and "removed at the end" in intro and "not the table's" in intro


def test_finetune_demo_removes_the_temporary_directory_it_made(tmp_path):
    from zeroshard.train.demo import demo_dir
    with demo_dir(None) as made:
        assert os.path.isdir(made)
    assert not os.path.exists(made)
    with pytest.raises(RuntimeError), demo_dir(None) as failed:  # (also when the demo fails)
        raise RuntimeError("demo failed")
    assert not os.path.exists(failed)
    with demo_dir(str(tmp_path)) as given:  # --workdir: kept
        pass
    assert given == str(tmp_path) and tmp_path.is_dir()
