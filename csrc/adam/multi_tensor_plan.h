// Host-side planning of multi-tensor launches (see Note [multi-tensor launch] in
// cuda_adam_kernel.cu). Plain C++ without CUDA headers so it is unit-tested on any machine
// (tests/ops/test_ops_cuda.py compiles a checker against it with g++).
#pragma once

#include <stdint.h>

namespace zeroshard {
namespace cuda {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;

// One tensor of a multi-tensor step; all five buffers have `numel` elements.
struct TensorRef {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out_lowp;  // nullptr when no copy-out
  int64_t numel;
};

// The kernel's argument block: tensor slots and the block -> (slot, chunk) map.
struct TensorListMeta {
  float* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  void* out[kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

inline void set_slot(TensorListMeta& meta, int slot, const TensorRef& r) {
  meta.param[slot] = r.param;
  meta.grad[slot] = r.grad;
  meta.exp_avg[slot] = r.exp_avg;
  meta.exp_avg_sq[slot] = r.exp_avg_sq;
  meta.out[slot] = r.out_lowp;
  meta.numel[slot] = r.numel;
}

// Fills `meta` and calls launch(meta, nblocks) whenever blocks or tensor slots run out; a
// tensor whose chunks straddle two launches is carried over to slot 0. `launch` returns false
// to stop (a launch error). Returns false if any launch did.
template <class Launch>
bool plan_multi_tensor(const TensorRef* refs, int n, TensorListMeta& meta, Launch&& launch) {
  int nt = 0;
  int nb = 0;
  for (int r = 0; r < n; ++r) {
    if (refs[r].numel == 0) continue;
    set_slot(meta, nt, refs[r]);
    const int64_t chunks = (refs[r].numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[nb] = static_cast<unsigned char>(nt);
      meta.block_chunk[nb] = static_cast<int>(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == kMaxBlocks || (last_chunk && nt + 1 == kMaxTensors)) {
        if (!launch(meta, nb)) return false;
        nb = 0;
        if (last_chunk) {
          nt = -1;  // the next tensor starts at slot 0
        } else {
          set_slot(meta, 0, refs[r]);
          nt = 0;
        }
      }
    }
    ++nt;
  }
  return nb == 0 || launch(meta, nb);
}

}  // namespace cuda
}  // namespace zeroshard
