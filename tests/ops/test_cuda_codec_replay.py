"""The CUDA block codecs (csrc/adam/cuda_codec_kernel.cu) write the CPU kernels' bytes and decode
to their values, checked without a GPU: nvcc compiles the real kernel source, whose per-thread
bodies are __host__ __device__, and a host program replays every thread of every launch (Note
[CUDA codec phases]); skips without nvcc. On a GPU, tests/ops/test_codec_kernel.py runs the
kernel itself."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from tests.support.codec_data import codec_data, same_values, torch_path
from zeroshard.comm.codecs.codec_formats import Fp8Codec, Int4Codec, Int8Codec

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc", "adam")
KINDS = {"int8": (0, Int8Codec), "fp8": (1, Fp8Codec), "int4": (2, Int4Codec)}

_REPLAY = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cuda_codec_kernel.cu"
using namespace zeroshard::cuda;

constexpr int kGuard = 16;

// Every thread of every launch of an encode and then of a decode, in launch order (each launch
// finishes before the next starts, as on one stream); guard bytes past each buffer's end must
// survive.
template <int KIND>
bool replay(const std::vector<float>& x, int64_t block, int64_t max_blocks, std::vector<uint8_t>& buf,
            std::vector<float>& out) {
  const int64_t n = static_cast<int64_t>(x.size()), nb = (n + block - 1) / block;
  const int64_t bytes = nb * block / Codec<KIND>::kPerByte;
  buf.assign(4 * nb + bytes + kGuard, 0xA5);
  out.assign(n + kGuard, -3.0f);
  int grid = codec_grid(nb, max_blocks);
  for (int b = 0; b < grid; ++b)
    for (int t = 0; t < kCodecThreads; ++t)
      scale_thread<KIND>(x.data(), n, block, buf.data(), int64_t(b) * kCodecThreads + t, int64_t(grid) * kCodecThreads);
  grid = codec_grid(bytes, max_blocks);
  for (int b = 0; b < grid; ++b)
    for (int t = 0; t < kCodecThreads; ++t)
      code_thread<KIND>(x.data(), n, block, buf.data(), int64_t(b) * kCodecThreads + t, int64_t(grid) * kCodecThreads);
  grid = codec_grid(n, max_blocks);
  for (int b = 0; b < grid; ++b)
    for (int t = 0; t < kCodecThreads; ++t)
      decode_thread<KIND>(buf.data(), n, block, out.data(), int64_t(b) * kCodecThreads + t, int64_t(grid) * kCodecThreads);
  for (int k = 0; k < kGuard; ++k)
    if (buf[4 * nb + bytes + k] != 0xA5 || out[n + k] != -3.0f) return false;
  buf.resize(4 * nb + bytes);
  out.resize(n);
  return true;
}

// argv: groups of <kind> <block> <max grid blocks> <input f32 file> <bytes file> <decoded f32 file>
int main(int argc, char** argv) {
  for (int a = 1; a + 5 < argc; a += 6) {
    const int kind = std::atoi(argv[a]);
    const int64_t block = std::atoll(argv[a + 1]), max_blocks = std::atoll(argv[a + 2]);
    FILE* f = std::fopen(argv[a + 3], "rb");
    std::fseek(f, 0, SEEK_END);
    std::vector<float> x(std::ftell(f) / 4);
    std::fseek(f, 0, SEEK_SET);
    if (std::fread(x.data(), 4, x.size(), f) != x.size()) return 3;
    std::fclose(f);
    std::vector<uint8_t> buf;
    std::vector<float> out;
    const bool ok = kind == kCodecInt8 ? replay<kCodecInt8>(x, block, max_blocks, buf, out)
                  : kind == kCodecFp8  ? replay<kCodecFp8>(x, block, max_blocks, buf, out)
                                       : replay<kCodecInt4>(x, block, max_blocks, buf, out);
    if (!ok) { std::printf("write past the end: case %d\n", a / 6); return 2; }
    f = std::fopen(argv[a + 4], "wb");
    std::fwrite(buf.data(), 1, buf.size(), f);
    std::fclose(f);
    f = std::fopen(argv[a + 5], "wb");
    std::fwrite(out.data(), 4, out.size(), f);
    std::fclose(f);
  }
  std::puts("OK");
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
def test_cuda_codec_grid_replayed_on_host_equals_the_cpu_kernel(tmp_path) -> None:
    src = tmp_path / "codec_replay.cu"
    src.write_text(_REPLAY)
    exe = tmp_path / "codec_replay"
    build = subprocess.run(["nvcc", "-std=c++17", "-O1", "-arch=sm_80", f"-I{_CSRC}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "unsupported GNU version" in build.stderr:
        pytest.skip("nvcc does not support this host compiler")
    assert build.returncode == 0, build.stderr[-3000:]
    # Sizes: one element, a padded last block, whole blocks, and enough blocks for the zero,
    # constant, inf and NaN blocks of codec_data; max grid 2 makes every thread stride.
    cases = [(name, block, n, grid) for name in KINDS for block in (2, 34, 256)
             for n, grid in ((1, 1 << 16), (7, 1 << 16), (block * 9, 1 << 16), (20_003, 1 << 16), (20_003, 2))]
    args = []
    for k, (name, block, n, grid) in enumerate(cases):
        codec_data(n, block, non_finite=True).numpy().tofile(tmp_path / f"x{k}")
        args += [str(KINDS[name][0]), str(block), str(grid), str(tmp_path / f"x{k}"), str(tmp_path / f"b{k}"),
                 str(tmp_path / f"d{k}")]
    run = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
    for k, (name, block, n, grid) in enumerate(cases):
        codec = KINDS[name][1](block=block)
        x = codec_data(n, block, non_finite=True)
        want, ref = torch_path(codec, x)  # (tests/ops/test_codec_kernel.py equals it to the CPU kernel's)
        got = torch.from_file(str(tmp_path / f"b{k}"), size=want.numel(), dtype=torch.uint8)
        assert torch.equal(got, want), (name, block, n, grid, (got != want).nonzero()[:5].flatten().tolist())
        cpu = torch.full_like(want, 7)
        codec.encode(x, cpu)  # (the CPU kernel where it is built)
        assert torch.equal(got, cpu), (name, block, n, grid)
        dec = torch.from_file(str(tmp_path / f"d{k}"), size=n, dtype=torch.float32)
        assert same_values(dec, ref), (name, block, n, grid)
