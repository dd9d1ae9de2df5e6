"""Issue 39: the just-in-time kernel cache is keyed by everything the build depends on
(Note [kernel cache key] in zeroshard/ops/_loader.py), so two environments sharing the cache
never rebuild each other's build in place."""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from zeroshard.ops import _loader
from zeroshard.ops._build_spec import CPU_ADAM, csrc_dir


@pytest.fixture
def sources(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(csrc_dir(), root)
    return str(root)


def test_build_directory_changes_with_what_the_build_reads(sources, tmp_path, monkeypatch):
    for k in ("CXX", "CPLUS_INCLUDE_PATH", "CFLAGS"):
        monkeypatch.delenv(k, raising=False)
    base = _loader.build_dir(CPU_ADAM, sources)
    assert base == _loader.build_dir(CPU_ADAM, sources)  # deterministic: a second process reuses it
    assert os.path.dirname(base) == _loader.cache_dir()

    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(tmp_path / "other-include"))  # another environment's headers
    assert _loader.build_dir(CPU_ADAM, sources) != base
    monkeypatch.delenv("CPLUS_INCLUDE_PATH")

    fake_cxx = tmp_path / "bin" / "g++-other"
    fake_cxx.parent.mkdir()
    fake_cxx.write_text("#!/bin/sh\n")
    fake_cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake_cxx))  # another compiler
    assert _loader.build_dir(CPU_ADAM, sources) != base
    monkeypatch.delenv("CXX")

    assert _loader.build_dir(dataclasses.replace(CPU_ADAM, cflags=CPU_ADAM.cflags + ("-DX",)), sources) != base

    header = os.path.join(sources, "adam", "adam_common.h")  # a header the sources include
    with open(header, "a") as f:
        f.write("\n// changed\n")
    assert _loader.build_dir(CPU_ADAM, sources) != base
    assert _loader.build_dir(CPU_ADAM, sources) == _loader.build_dir(CPU_ADAM, sources)


def test_two_checkouts_of_the_same_sources_keep_a_build_each(sources, tmp_path):
    """The build files name the sources by path: two checkouts sharing one cache and one build
    directory recompiled it in place for each other on every alternate use (jobs waited minutes
    on the lock), so the sources' directory is part of the key."""
    other = str(tmp_path / "other-checkout" / "csrc")
    shutil.copytree(sources, other)
    assert _loader.build_dir(CPU_ADAM, other) != _loader.build_dir(CPU_ADAM, sources)


def test_the_loaded_kernel_lives_in_its_keyed_directory():
    state = _loader.REGISTRY.cpu()
    if state.source != "jit":
        pytest.skip(f"the CPU kernel was not built just in time here ({state.source}: {state.reason})")
    where = _loader.build_dir(CPU_ADAM, csrc_dir())
    assert os.path.dirname(os.path.realpath(state.module.__file__)) == os.path.realpath(where)
