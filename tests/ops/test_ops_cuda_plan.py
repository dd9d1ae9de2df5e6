"""The CUDA kernel's launch planner (csrc/adam/multi_tensor_plan.h), checked on the host.

The planner decides which block updates which chunk of which tensor; a slip there silently
skips or double-updates parameters, and no GPU is needed to check it: a small C++ program
replays every launch and counts how often each (tensor, chunk) was assigned.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc", "adam")

_CHECKER = r"""
#include <cstdio>
#include <map>
#include <utility>
#include <vector>
#include "multi_tensor_plan.h"
using namespace zeroshard::cuda;

int check(const std::vector<int64_t>& sizes) {
  std::vector<TensorRef> refs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    float* fake = reinterpret_cast<float*>(static_cast<uintptr_t>(64 * (i + 1)));
    refs.push_back(TensorRef{fake, fake, fake, fake, nullptr, sizes[i]});
  }
  std::map<std::pair<size_t, int64_t>, int> seen;
  TensorListMeta meta;
  int launches = 0;
  bool ok = plan_multi_tensor(refs.data(), static_cast<int>(refs.size()), meta,
                              [&](const TensorListMeta& m, int nb) {
    ++launches;
    if (nb < 1 || nb > kMaxBlocks) return false;
    for (int b = 0; b < nb; ++b) {
      const int t = m.block_tensor[b];
      if (t >= kMaxTensors) return false;
      const size_t r = reinterpret_cast<uintptr_t>(m.param[t]) / 64 - 1;
      if (r >= refs.size() || m.numel[t] != sizes[r]) return false;
      if (static_cast<int64_t>(m.block_chunk[b]) * kChunk >= sizes[r]) return false;
      ++seen[{r, m.block_chunk[b]}];
    }
    return true;
  });
  if (!ok) return 1;
  for (size_t r = 0; r < sizes.size(); ++r) {
    for (int64_t c = 0; c * kChunk < sizes[r]; ++c) {
      if (seen[{r, c}] != 1) { std::printf("tensor %zu chunk %lld seen %d\n", r, (long long)c, seen[{r, c}]); return 2; }
    }
  }
  size_t expected = 0;
  for (int64_t s : sizes) expected += (s + kChunk - 1) / kChunk;
  if (seen.size() != expected) return 3;
  return 0;
}

int main() {
  std::vector<std::vector<int64_t>> cases = {
    {}, {0}, {1}, {kChunk}, {kChunk + 1}, {kChunk * kMaxBlocks}, {kChunk * kMaxBlocks + 1},
    {kChunk * 1000 + 7}, std::vector<int64_t>(kMaxTensors, 5), std::vector<int64_t>(kMaxTensors + 1, 5),
    std::vector<int64_t>(500, 3),
  };
  std::vector<int64_t> mixed;
  uint64_t x = 12345;
  for (int i = 0; i < 400; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t kinds[] = {0, 1, 17, kChunk - 1, kChunk, 3 * kChunk + 5, 40 * kChunk + 1};
    mixed.push_back(kinds[(x >> 33) % 7]);
  }
  cases.push_back(mixed);
  for (size_t i = 0; i < cases.size(); ++i) {
    if (int rc = check(cases[i])) { std::printf("case %zu failed: %d\n", i, rc); return 1; }
  }
  std::puts("OK");
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_every_chunk_is_planned_exactly_once(tmp_path: pytest.TempPathFactory) -> None:
    src = tmp_path / "plan_check.cpp"
    src.write_text(_CHECKER)
    exe = tmp_path / "plan_check"
    build = subprocess.run(["g++", "-std=c++17", "-O1", f"-I{_CSRC}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr


_REPLAY = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "cuda_adam_kernel.cu"
using namespace zeroshard;
using namespace zeroshard::cuda;

static uint64_t rng = 88172645463325252ull;
static float uniform(float lo, float hi) {
  rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
  return lo + (hi - lo) * static_cast<float>(rng >> 40) / static_cast<float>(1 << 24);
}

template <typename T> struct Buf {
  std::vector<T> data; size_t off;
  Buf(int64_t n, size_t offset) : data(n + 8), off(offset) {}
  T* ptr() { return data.data() + off; }
};

// Replays every block and thread of every launch on the host and compares with a plain
// per-element loop over the same function: a missed, doubled or misplaced element differs.
template <typename GT, typename OT, bool HAS_OUT, bool ADAMW>
int run_case(const std::vector<int64_t>& sizes) {
  cpu::AdamScalars s{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.02f, 1.0f - 1e-3f * 0.02f, -1e-3f / 0.271f, 1.0f / 0.0547f,
                     1.0f / 64.0f, ADAMW ? 1 : 0};
  std::vector<Buf<float>> p, m, v, pr, mr, vr;
  std::vector<Buf<GT>> g;
  std::vector<Buf<OT>> o, orf;
  std::vector<TensorRef> refs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t off = i % 3 == 1 ? 1 : 0;  // every third tensor misaligned: scalar path
    p.emplace_back(sizes[i], off); m.emplace_back(sizes[i], off); v.emplace_back(sizes[i], off);
    g.emplace_back(sizes[i], i % 5 == 2 ? 1 : 0); o.emplace_back(sizes[i], 0);
    // Fill the guard elements around each tensor too (with values the update would change),
    // so a write past either end shows up in the comparison of the whole buffers below.
    for (size_t k = 0; k < p[i].data.size(); ++k) {
      p[i].data[k] = uniform(-1, 1); m[i].data[k] = uniform(-0.01f, 0.01f); v[i].data[k] = uniform(0, 1e-4f);
      o[i].data[k] = from_float_any<OT>(uniform(-1, 1));
    }
    for (size_t k = 0; k < g[i].data.size(); ++k) g[i].data[k] = from_float_any<GT>(uniform(-64, 64));
    pr.push_back(p[i]); mr.push_back(m[i]); vr.push_back(v[i]); orf.push_back(o[i]);
  }
  for (size_t i = 0; i < sizes.size(); ++i)
    refs.push_back(TensorRef{p[i].ptr(), g[i].ptr(), m[i].ptr(), v[i].ptr(), HAS_OUT ? o[i].ptr() : nullptr, sizes[i]});
  TensorListMeta meta;
  int launches = 0;
  plan_multi_tensor(refs.data(), static_cast<int>(refs.size()), meta, [&](const TensorListMeta& mm, int nb) {
    ++launches;
    for (int b = 0; b < nb; ++b)
      for (int t = 0; t < kThreads; ++t) adam_thread<GT, OT, HAS_OUT, ADAMW>(mm, s, b, t, kThreads);
    return true;
  });
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t k = 0; k < sizes[i]; ++k) {
      adam_elem<ADAMW>(pr[i].ptr()[k], to_float(g[i].ptr()[k]), mr[i].ptr()[k], vr[i].ptr()[k], s);
      if (HAS_OUT) orf[i].ptr()[k] = from_float<OT>(pr[i].ptr()[k]);
    }
    const size_t nb = p[i].data.size() * sizeof(float);
    if (memcmp(p[i].data.data(), pr[i].data.data(), nb) || memcmp(m[i].data.data(), mr[i].data.data(), nb) ||
        memcmp(v[i].data.data(), vr[i].data.data(), nb) ||
        memcmp(o[i].data.data(), orf[i].data.data(), o[i].data.size() * sizeof(OT))) {
      std::printf("mismatch in tensor %zu (numel %lld)\n", i, static_cast<long long>(sizes[i]));
      return 1;
    }
  }
  return launches > 1 ? 0 : 2;  // the tensor list must span several launches
}

int main() {
  std::vector<int64_t> sizes = {0, 1, 3, 4, 5, 1023, 65536, 65537, 200003};
  for (int k = 0; k < 40; ++k) sizes.push_back(97 * k + 1);
  int rc = 0;
  rc |= run_case<float, __nv_bfloat16, false, true>(sizes);
  rc |= run_case<float, __nv_bfloat16, false, false>(sizes);
  rc |= run_case<__nv_bfloat16, __nv_bfloat16, true, true>(sizes);
  rc |= run_case<__half, __half, true, false>(sizes);
  rc |= run_case<__nv_bfloat16, __half, true, true>(sizes);
  if (rc == 0) std::puts("OK");
  return rc;
}
"""

# Host-side helper the replay needs: fp32 -> gradient element type.
_HELPER = r"""
template <typename T> static T from_float_any(float x);
template <> float from_float_any<float>(float x) { return x; }
template <> __nv_bfloat16 from_float_any<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __half from_float_any<__half>(float x) { return __float2half_rn(x); }
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
def test_cuda_kernel_grid_replayed_on_host(tmp_path: pytest.TempPathFactory) -> None:
    # nvcc compiles the real kernel source; its per-thread body is __host__ __device__, so the
    # whole grid runs here on the CPU. No GPU and no CUDA build of torch are involved.
    src = tmp_path / "replay.cu"
    src.write_text(_REPLAY.replace('#include "cuda_adam_kernel.cu"\n', '#include "cuda_adam_kernel.cu"\n' + _HELPER))
    exe = tmp_path / "replay"
    build = subprocess.run(["nvcc", "-std=c++17", "-O1", "-arch=sm_80", "-D__CUDA_NO_HALF_OPERATORS__",
                            "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                            f"-I{_CSRC}", str(src), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "unsupported GNU version" in build.stderr:
        pytest.skip("nvcc does not support this host compiler")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
