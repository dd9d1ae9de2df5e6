"""Shared fixtures for the tests of zeroshard.io (no tests here): both backends, small real file systems."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import torch

from zeroshard.io import AsyncIO, aligned_empty
from zeroshard.io._native import native

BACKENDS = ("native", "kaio", "python")


def make_engine(backend: str, **kwargs) -> AsyncIO:
    """An engine on ``backend``; skips (with the loader's reason) when the native one is absent."""
    if backend in ("native", "kaio") and native().module is None:
        pytest.skip(f"native I/O engine unavailable: {native().reason}")
    return AsyncIO(backend=backend, **kwargs)


def pattern(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """An aligned buffer of reproducible, non-zero values (so "silent zeros" cannot pass)."""
    g = torch.Generator().manual_seed(seed)
    t = aligned_empty(numel, dtype, pin=False)
    t.copy_(torch.rand(numel, generator=g).add_(1.0).to(dtype))
    return t


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def small_filesystem(where: str, size_mb: int = 8) -> Iterator[str]:
    """A mounted file system of ``size_mb`` MiB: a loop-device ext4 image (real O_DIRECT
    semantics) or, failing that, a tmpfs. Skips when this process cannot mount (not root).
    Always unmounted in ``finally``."""
    mnt = os.path.join(where, "mnt")
    os.makedirs(mnt, exist_ok=True)
    image = os.path.join(where, "disk.img")
    mounted = False
    try:
        try:
            with open(image, "wb") as f:
                f.truncate(size_mb << 20)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", image)
            _run("mount", "-o", "loop", image, mnt)
            mounted = True
        except (OSError, subprocess.SubprocessError):
            try:
                _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", mnt)
                mounted = True
            except (OSError, subprocess.SubprocessError) as exc:
                pytest.skip(f"cannot mount a small file system here (needs root): {exc}")
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", mnt], capture_output=True, timeout=60)
        if os.path.exists(image):
            os.remove(image)


@contextlib.contextmanager
def read_only_mount(where: str) -> Iterator[str]:
    """A read-only tmpfs (root writes through chmod, so a mount is the only real refusal)."""
    mnt = os.path.join(where, "ro")
    os.makedirs(mnt, exist_ok=True)
    try:
        _run("mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", mnt)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a read-only file system here (needs root): {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], capture_output=True, timeout=60)


def refuse_o_direct(monkeypatch) -> None:
    """A file system that refuses O_DIRECT at open() (EINVAL, as tmpfs did before Linux 6.6):
    simulated by failing exactly that open() call, since every file system here accepts it."""
    import errno
    import os

    from zeroshard.io import _plan
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kw)
    monkeypatch.setattr(_plan.os, "open", refusing_open)
    monkeypatch.setattr(_plan, "_direct_refusals", {})


def fill_disk(directory: str, name: str = "filler") -> None:
    """Writes ``name`` until the file system is full."""
    with open(os.path.join(directory, name), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass


def mount_tmpfs(size: str, ro: bool = False) -> str:
    """A fresh tmpfs of ``size`` (read-only with ``ro``); skips where mounting needs root."""
    d = tempfile.mkdtemp()
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here (needs root): {r.stderr.decode().strip()}")
    return d
