"""zeroshard packaging.

Native kernels (``csrc/``) are optional and by default are not compiled here:
``zeroshard.ops`` builds them on first use (once per machine, cached, with a progress line
every 10 s; see Note [build progress] in zeroshard/ops/_loader.py), because pip hides a
build's output and a compile at install is a minute of silence. ``ZEROSHARD_BUILD_KERNELS=1``
compiles them at install instead (for images whose runtime has no compiler), each kernel's
files in parallel with ninja (``MAX_JOBS`` caps the jobs). Either way, failing that a
pure-PyTorch path runs: installation never fails because a kernel could not be compiled
(see ``_OptionalBuildExt``).

Build with ``pip install --no-build-isolation -e .`` so that the torch already in the
environment is used at build time instead of pip fetching a new one.
"""
from __future__ import annotations

import os
import shutil
import sys
import time

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def _extensions() -> tuple[list, dict]:
    """Extension modules and cmdclass; nothing unless ZEROSHARD_BUILD_KERNELS=1, or without torch."""
    # ZEROSHARD_NO_BUILD=1 (the old opt-out) still wins over ZEROSHARD_BUILD_KERNELS=1.
    if os.environ.get("ZEROSHARD_BUILD_KERNELS", "0") != "1" or os.environ.get("ZEROSHARD_NO_BUILD", "0") == "1":
        return [], {}
    try:
        from torch.utils import cpp_extension  # noqa: F401
    except Exception as exc:  # torch absent at build time: JIT build later
        print(f"zeroshard: skipping native build ({exc!r}); kernels build on first use", file=sys.stderr)
        return [], {}
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "zeroshard", "ops"))
        import _build_spec  # type: ignore  # the single source of kernel sources and flags
    finally:
        sys.path.pop(0)
    exts = _build_spec.setup_extensions()
    # ninja compiles an extension's files in parallel (BuildExtension falls back to one at a
    # time, with a warning, where ninja is missing).
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class _OptionalBuildExt(base):  # type: ignore[misc, valid-type]
        """Builds each kernel on its own; a failure is reported, never fatal."""

        def build_extension(self, ext):  # noqa: D401
            t0 = time.monotonic()
            print(f"zeroshard: compiling {ext.name} ({len(ext.sources)} files)", file=sys.stderr, flush=True)
            try:
                super().build_extension(ext)
            except Exception as exc:  # compiler missing, CUDA mismatch, ...
                print(f"zeroshard: could not build {ext.name}: {exc}; it will be built on "
                      "first use or replaced by the PyTorch fallback", file=sys.stderr)
            else:
                print(f"zeroshard: {ext.name} built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    return exts, {"build_ext": _OptionalBuildExt}


class _BuildPyWithKernelSources(build_py):
    """Ships ``csrc/`` inside the package (``zeroshard/csrc``) so an installed wheel can still
    build the kernels just in time when setup.py could not (zeroshard.ops._build_spec.csrc_dir
    looks there first). Editable installs read the repository's ``csrc/`` directly."""

    def run(self) -> None:
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
        if os.path.isdir(src) and not getattr(self, "editable_mode", False):
            shutil.copytree(src, os.path.join(self.build_lib, "zeroshard", "csrc"), dirs_exist_ok=True)


ext_modules, cmdclass = _extensions()
cmdclass = {**cmdclass, "build_py": _BuildPyWithKernelSources}

setup(
    name="zeroshard",
    version="0.1.0",
    description="ZeRO stages 0-3 as a drop-in torch.optim optimizer, with offload and resumable sharded checkpoints",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["zeroshard", "zeroshard.*"]),
    install_requires=[
        "torch>=2.4,<3",
        "numpy>=1.24",
        "safetensors>=0.4",
        "psutil>=5.9",
    ],
    extras_require={
        # transformers: the stage-3 and checkpoint tests use a small GPT-2 built from a config
        # (no download); it does not depend on torch, so it never pulls a CUDA build.
        # matplotlib: the memory chart of `zeroshard bench memory` is tested too.
        # peft: tests/integrations/test_lora.py (LoRA on a frozen, stage-3-partitioned base; accepts torch>=1.13).
        # accelerate, lightning: tests/integrations/test_integrations.py (both accept torch>=2.1, so the pinned
        # torch stays).
        # ruff, mypy: tests/unit/test_structure.py (static checks: undefined and unused names, syntax,
        # types over zeroshard/ with .ci/mypy.ini).
        # trl: tests/integrations/test_trl_sft.py (SFTTrainer with a ZeroOptimizer; it pulls datasets, pandas and
        # pyarrow, and accepts torch>=2.6, so the pinned torch stays).
        # deepspeed: tests/train/test_deepspeed_front.py runs the same script under the real DeepSpeed (CPU,
        # gloo, torch_adam; its ops build just in time, so no CUDA toolkit; it accepts torch>=2.0).
        "test": ["pytest>=7", "pytest-benchmark>=4", "transformers>=4.40", "matplotlib>=3.7",
                 "accelerate>=1.0,<2", "lightning>=2.2,<3", "peft>=0.13,<1", "deepspeed>=0.19,<0.20",
                 "trl>=1.0,<2", "ruff>=0.6", "mypy>=1.10"],
        "bench": ["pytest-benchmark>=4", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["zeroshard=zeroshard.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
