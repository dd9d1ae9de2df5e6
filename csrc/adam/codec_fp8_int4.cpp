// Block-wise fp8 (e4m3fn) and int4 encode / decode of float32, straight into and out of a
// collective's byte buffer: the C++ twins of the torch path's Fp8Codec and Int4Codec
// (zeroshard/comm/codecs/codec_formats.py; Note [codec error bounds] there), the same operations
// in the same order so the bytes and the decoded values equal it bit for bit
// (tests/ops/test_codec_kernel.py), blocks in parallel and independent of the thread count.
//
// Per block of `block` elements: an fp32 scale (codec_common.h), then each x / divisor clamped
// to [-qmax, qmax] and
// - fp8: converted as c10's fp8e4m3fn_from_fp32_value converts (round to nearest even, values
//   below e4m3's smallest normal rounded as subnormals by one fp32 addition, NaN -> 0x7f with
//   its sign, a rounding that would reach 0x7f saturated to 0x7e); decoded through a 256-entry
//   table of c10's fp8e4m3fn_to_fp32_value, times the scale;
// - int4: round half to even, + 8, two codes per byte (low nibble first); a NaN's code is 0,
//   what torch's float -> uint8 conversion gives on x86 (the block decodes to NaN anyway: its
//   scale is NaN or inf). Padding to whole blocks encodes zeros (fp8 0x00, int4 code 8).
//
// Both have AVX2 builds too (codec_blocks_avx2.cpp, equal byte for byte; the binding picks them
// as it picks int8's). No torch headers here (the binding is in cpu_adam.cpp: Note [compile time]).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "codec_common.h"

namespace zeroshard {
namespace cpu {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint8_t e4m3_from_float(float f) {
  constexpr uint32_t fp8_max = UINT32_C(1087) << 20;
  constexpr uint32_t denorm_mask = UINT32_C(141) << 23;
  uint32_t f_bits = bits_of(f);
  uint8_t result;
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  if (f_bits >= fp8_max) {
    result = f_bits > UINT32_C(0x7F800000) ? 0x7f : 0x7e;
  } else if (f_bits < (UINT32_C(121) << 23)) {  // below 2^-6: a subnormal, rounded by the FPU
    f_bits = bits_of(float_of(f_bits) + float_of(denorm_mask));
    result = static_cast<uint8_t>(f_bits - denorm_mask);
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1;
    f_bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
    if (result == 0x7f) result = 0x7e;
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

inline float e4m3_to_float(uint8_t input) {
  const uint32_t w = (uint32_t)input << 24;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t nonsign = w & UINT32_C(0x7FFFFFFF);
  uint32_t renorm_shift = nonsign != 0 ? __builtin_clz(nonsign) : 32;
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask = ((int32_t)(nonsign + 0x01000000) >> 8) & INT32_C(0x7F800000);
  const int32_t zero_mask = (int32_t)(nonsign - 1) >> 31;
  return float_of(sign | ((((nonsign << renorm_shift >> 4) + ((0x78 - renorm_shift) << 23)) | inf_nan_mask) &
                          ~zero_mask));
}

struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_float(static_cast<uint8_t>(i));
  }
};


inline float clamp_q(float v, float qmax) { return v < -qmax ? -qmax : (v > qmax ? qmax : v); }

inline uint8_t int4_code(float v) {
  return v != v ? 0 : static_cast<uint8_t>(nearbyintf(clamp_q(v, 7.0f)) + 8.0f);
}

}  // namespace

// (not inline, not in the anonymous namespace: the AVX2 build calls it for a block's tail)
uint8_t e4m3_code(float v) { return e4m3_from_float(clamp_q(v, 448.0f)); }

// (not inline, not in the anonymous namespace: the AVX2 decode gathers from it too)
const float* e4m3_decode_table() {
  static const E4m3Table table;
  return table.v;
}

void fp8_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  uint8_t* q = buf + 4 * nb;
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale(x, lo, hi, 448.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    for (int64_t i = lo; i < hi; ++i) q[i] = e4m3_code(x[i] / d);
    for (int64_t i = hi; i < lo + block; ++i) q[i] = 0;
  }
}

void fp8_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const uint8_t* q = buf + 4 * nb;
  const float* table = e4m3_decode_table();
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    for (int64_t i = lo; i < hi; ++i) out[i] = table[q[i]] * scale;
  }
}

void int4_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  uint8_t* q = buf + 4 * nb;  // (block is even: a byte's two codes are of one block)
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale(x, lo, hi, 7.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    for (int64_t i = lo; i < lo + block; i += 2) {
      const uint8_t c0 = i < hi ? int4_code(x[i] / d) : 8;
      const uint8_t c1 = i + 1 < hi ? int4_code(x[i + 1] / d) : 8;
      q[i / 2] = static_cast<uint8_t>(c0 | (c1 << 4));
    }
  }
}

void int4_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const uint8_t* q = buf + 4 * nb;
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    for (int64_t i = lo; i < hi; ++i) {
      const int code = (i & 1) ? q[i / 2] >> 4 : q[i / 2] & 0x0F;
      out[i] = static_cast<float>(code - 8) * scale;
    }
  }
}

}  // namespace cpu
}  // namespace zeroshard
