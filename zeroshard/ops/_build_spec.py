"""Kernel sources and flags: the one place both setup.py and the JIT loader read.

Kept free of zeroshard imports so setup.py can load it before the package is installed.

Note [kernel flags]: ``-fno-math-errno`` is what lets gcc turn ``sqrtf`` into ``vsqrtps``
instead of a libm call that must set errno (without it the loop runs ~3x below the memory
ceiling); ``-ffp-contract=off`` keeps the compiler from fusing a product and a sum the
sources round separately (Note [unfused update] in csrc/adam/adam_body.inc: the same bits on
every instruction set, and torch's); ``-O3`` and ``-fopenmp`` for vectorised, threaded loops. The instruction set is
chosen at run time (see csrc/adam/adam_common.h), so no ``-march`` here: the library must
load on any x86-64 CPU. ``-g0`` overrides the ``-g`` that setup.py inherits from Python's
CFLAGS: debug information does not change the generated code (the objects disassemble
identically) but costs a third of the compile time and 12 MB of library.

Note [compile time]: the build is dominated by torch's headers, so only the binding
(cpu_adam.cpp) includes them, and only the ones it uses; grad_sqnorm.cpp and the ISA files
include none (codec_int8.cpp, codec_blocks_avx2.cpp, codec_fp8_int4.cpp: the block codecs of
quantized collectives, bound there too). The
five Adam files compile in ~25 s on 2 cores, most of it cpu_adam.cpp.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class KernelSpec:
    """How to build one native kernel, at install time or just in time."""

    name: str
    """Module name when installed by setup.py (imported as ``zeroshard.ops.<name>``)."""
    jit_name: str
    """Module name for torch.utils.cpp_extension.load (unique in the JIT cache)."""
    sources: tuple[str, ...]
    """Paths relative to the ``csrc`` directory."""
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    cuda: bool = False


CPU_ADAM = KernelSpec(
    name="_cpu_adam",
    jit_name="zeroshard_cpu_adam",
    sources=("adam/cpu_adam.cpp", "adam/adam_avx512.cpp", "adam/adam_avx2.cpp", "adam/adam_scalar.cpp",
             "adam/grad_sqnorm.cpp", "adam/codec_int8.cpp", "adam/codec_blocks_avx2.cpp", "adam/codec_fp8_int4.cpp"),
    cflags=("-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-g0"),
    ldflags=("-fopenmp",),
)

CUDA_ADAM = KernelSpec(
    name="_cuda_adam",
    jit_name="zeroshard_cuda_adam",
    # (the block codecs of quantized collectives ride in this module: cuda_adam.cpp registers them)
    sources=("adam/cuda_adam.cpp", "adam/cuda_adam_kernel.cu", "adam/cuda_codec.cpp", "adam/cuda_codec_kernel.cu"),
    cflags=("-O3",),
    ldflags=(),
    # No --use_fast_math: the kernel must agree with torch.optim.AdamW to rounding.
    cuda_cflags=("-O3", "-lineinfo"),
    cuda=True,
)

SPECS: tuple[KernelSpec, ...] = (CPU_ADAM, CUDA_ADAM)


def csrc_dir() -> str | None:
    """The ``csrc`` directory: shipped inside the package, or at the repository root."""
    for cand in (os.path.join(_HERE, "..", "csrc"), os.path.join(_HERE, "..", "..", "csrc")):
        if os.path.isfile(os.path.join(cand, CPU_ADAM.sources[0])):
            return os.path.normpath(cand)
    return None


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot be compiled here, or None when it can."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception as exc:  # torch missing or broken: nothing native can build
        return f"torch is not importable ({exc!r})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    return None


def setup_extensions() -> list:
    """Extensions for setup.py, with source paths relative to the repository root."""
    from torch.utils import cpp_extension

    root = csrc_dir()
    if root is None:
        return []
    repo = os.path.dirname(root)

    def rel(spec: KernelSpec) -> list[str]:
        return [os.path.relpath(os.path.join(root, s), repo) for s in spec.sources]

    exts = [
        cpp_extension.CppExtension(
            f"zeroshard.ops.{CPU_ADAM.name}",
            rel(CPU_ADAM),
            extra_compile_args={"cxx": list(CPU_ADAM.cflags)},
            extra_link_args=list(CPU_ADAM.ldflags),
        )
    ]
    if cuda_unavailable_reason() is None:
        exts.append(
            cpp_extension.CUDAExtension(
                f"zeroshard.ops.{CUDA_ADAM.name}",
                rel(CUDA_ADAM),
                extra_compile_args={"cxx": list(CUDA_ADAM.cflags), "nvcc": list(CUDA_ADAM.cuda_cflags)},
                extra_link_args=list(CUDA_ADAM.ldflags),
            )
        )
    exts.append(cpp_extension.CppExtension(f"zeroshard.io.{AIO.name}", rel(AIO), extra_compile_args={"cxx": list(AIO.cflags)}))
    exts.append(cpp_extension.CppExtension(f"zeroshard.ops.{CHECKSUM.name}", rel(CHECKSUM),
                                           extra_compile_args={"cxx": list(CHECKSUM.cflags)}))
    return exts


# -- async I/O engine (csrc/aio; loaded by zeroshard/io/_native.py, owner: zeroshard.io) -------
AIO = KernelSpec(
    name="_aio",
    jit_name="zeroshard_aio",
    sources=("aio/aio_engine.cpp",),
    cflags=("-O2", "-g0"),
    ldflags=(),
)


# -- CRC-32C of the memory tier's slots (csrc/checksum; loaded by zeroshard/resilience/checksum.py through
# the kernels' _find: installed as zeroshard.ops._checksum, else built just in time) --
CHECKSUM = KernelSpec(
    name="_checksum",
    jit_name="zeroshard_checksum",
    sources=("checksum/crc32c.cpp",),
    cflags=("-O2", "-g0"),
    ldflags=(),
)
