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

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "adam")

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
