// What the block codecs (codec_int8.cpp, codec_blocks_avx2.cpp, codec_fp8_int4.cpp) share: the
// block's scale and divisor, as the torch path computes them (zeroshard/comm/codecs/codec_formats.py,
// _ScaledCodec._scaled): a = the block's largest magnitude, scale = a / qmax (NaN if the block
// holds a NaN: torch's amax propagates it), divisor = scale if scale > 0 else 1 (so a NaN scale
// divides by 1, as torch.where does). Everything here is in an anonymous namespace: the AVX2
// file includes it, and a shared inline function could otherwise be linked from its
// AVX2-compiled copy into code that runs on any CPU (Note [ISA translation units] in adam_common.h).
#pragma once

#include <stdint.h>  // (no math.h: its C++ overloads are shared inline functions)

namespace zeroshard {
namespace cpu {
namespace {

inline float block_scale(const float* x, int64_t lo, int64_t hi, float qmax) {
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = lo; i < hi; ++i) {
    const float v = __builtin_fabsf(x[i]);
    nan |= v != v;
    a = v > a ? v : a;
  }
  return nan ? __builtin_nanf("") : a / qmax;
}

inline float divisor_of(float scale) { return scale > 0.0f ? scale : 1.0f; }

// Threads for nb blocks: none below 64 blocks a thread (a fork costs more than it saves).
inline int codec_threads(int max_threads, int64_t nb) {
  const int64_t by_size = nb / 64 > 1 ? nb / 64 : 1;
  return static_cast<int>(max_threads < by_size ? max_threads : by_size);
}

}  // namespace
}  // namespace cpu
}  // namespace zeroshard
