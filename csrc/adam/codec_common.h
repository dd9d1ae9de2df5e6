// What the block codecs share: the CPU ones (codec_int8.cpp, codec_blocks_avx2.cpp,
// codec_fp8_int4.cpp) and the CUDA one (cuda_codec_kernel.cu), so their bytes are one function's.
//
// The block's scale and divisor, as the torch path computes them (zeroshard/comm/codecs/codec_formats.py,
// _ScaledCodec._scaled): a = the block's largest magnitude, scale = a / qmax (NaN if the block
// holds a NaN: torch's amax propagates it), divisor = scale if scale > 0 else 1 (so a NaN scale
// divides by 1, as torch.where does). Then each element's code (int8, int4, e4m3fn), and the
// per-range loops the portable paths run and the AVX2 paths run on a block's tail.
//
// Everything here is in an anonymous namespace: the AVX2 file includes it, and a shared inline
// function could otherwise be linked from its AVX2-compiled copy into code that runs on any CPU
// (Note [ISA translation units] in adam_common.h). Under nvcc every function is also a device
// function (CODEC_HD); what differs between host and device is
// an #ifdef __CUDA_ARCH__ (rounding, |x|, clz), the same IEEE operation on both.
#pragma once

#include <stdint.h>  // (no math.h: its C++ overloads are shared inline functions)
#include <string.h>

#ifdef __CUDACC__
#define CODEC_HD __host__ __device__ __forceinline__
#else
#define CODEC_HD inline
#endif

namespace zeroshard {
namespace cpu {
namespace {

// (memcpy: a bit cast the host and the device compilers both turn into a register move)
template <typename To, typename From>
CODEC_HD To codec_cast(From v) {
  To t;
  memcpy(&t, &v, sizeof(t));
  return t;
}

CODEC_HD uint32_t codec_bits(float f) { return codec_cast<uint32_t>(f); }
CODEC_HD float codec_float(uint32_t u) { return codec_cast<float>(u); }

// |v| and round half to even (the default rounding mode on the host; rn explicitly on the device).
#ifdef __CUDA_ARCH__
CODEC_HD float codec_abs(float v) { return fabsf(v); }
CODEC_HD float codec_round(float v) { return rintf(v); }
#else
CODEC_HD float codec_abs(float v) { return __builtin_fabsf(v); }
CODEC_HD float codec_round(float v) { return __builtin_nearbyintf(v); }
#endif

// Folds x[lo, hi) into a block's largest magnitude `a` and whether it holds a NaN (the order
// does not matter: a max is exact).
CODEC_HD void absmax_range(const float* x, int64_t lo, int64_t hi, float& a, bool& nan) {
  for (int64_t i = lo; i < hi; ++i) {
    const float v = codec_abs(x[i]);
    nan |= v != v;
    a = v > a ? v : a;
  }
}

CODEC_HD float scale_of(float a, bool nan, float qmax) { return nan ? codec_float(UINT32_C(0x7FC00000)) : a / qmax; }

CODEC_HD float block_scale(const float* x, int64_t lo, int64_t hi, float qmax) {
  float a = 0.0f;
  bool nan = false;
  absmax_range(x, lo, hi, a, nan);
  return scale_of(a, nan, qmax);
}

CODEC_HD float divisor_of(float scale) { return scale > 0.0f ? scale : 1.0f; }

CODEC_HD float clamp_q(float v, float qmax) { return v < -qmax ? -qmax : (v > qmax ? qmax : v); }

// A NaN's integer code is 0 (what torch's float -> int conversion gives on x86).
CODEC_HD int8_t int8_code(float v) { return v != v ? 0 : static_cast<int8_t>(codec_round(clamp_q(v, 127.0f))); }

CODEC_HD uint8_t int4_code(float v) {
  return v != v ? 0 : static_cast<uint8_t>(codec_round(clamp_q(v, 7.0f)) + 8.0f);
}

// c10's fp8e4m3fn_from_fp32_value.
CODEC_HD uint8_t e4m3_from_float(float f) {
  constexpr uint32_t fp8_max = UINT32_C(1087) << 20;
  constexpr uint32_t denorm_mask = UINT32_C(141) << 23;
  uint32_t f_bits = codec_bits(f);
  uint8_t result;
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  if (f_bits >= fp8_max) {
    result = f_bits > UINT32_C(0x7F800000) ? 0x7f : 0x7e;
  } else if (f_bits < (UINT32_C(121) << 23)) {  // below 2^-6: a subnormal, rounded by the FPU
    f_bits = codec_bits(codec_float(f_bits) + codec_float(denorm_mask));
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

// c10's fp8e4m3fn_to_fp32_value.
CODEC_HD float e4m3_to_float(uint8_t input) {
  const uint32_t w = (uint32_t)input << 24;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t nonsign = w & UINT32_C(0x7FFFFFFF);
#ifdef __CUDA_ARCH__
  uint32_t renorm_shift = static_cast<uint32_t>(__clz(static_cast<int>(nonsign)));
#else
  uint32_t renorm_shift = nonsign != 0 ? __builtin_clz(nonsign) : 32;
#endif
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask = ((int32_t)(nonsign + 0x01000000) >> 8) & INT32_C(0x7F800000);
  const int32_t zero_mask = (int32_t)(nonsign - 1) >> 31;
  return codec_float(sign | ((((nonsign << renorm_shift >> 4) + ((0x78 - renorm_shift) << 23)) | inf_nan_mask) &
                             ~zero_mask));
}

// A NaN passes the clamp with its sign, as c10's conversion then keeps it.
CODEC_HD uint8_t e4m3_code(float v) { return e4m3_from_float(clamp_q(v, 448.0f)); }

// The byte of int4 codes of elements i (low nibble) and i + 1 of x / d; elements at or past
// hi are padding (code 8, zero). i is even and so is a block: both codes are of one block.
CODEC_HD uint8_t int4_byte(const float* x, int64_t i, int64_t hi, float d) {
  const uint8_t c0 = i < hi ? int4_code(x[i] / d) : 8;
  const uint8_t c1 = i + 1 < hi ? int4_code(x[i + 1] / d) : 8;
  return static_cast<uint8_t>(c0 | (c1 << 4));
}

CODEC_HD float int4_value(const uint8_t* q, int64_t i) {
  const int code = (i & 1) ? q[i / 2] >> 4 : q[i / 2] & 0x0F;
  return static_cast<float>(code - 8);
}

// Per-range loops: codes of x[from, hi) / d, then padding codes up to `end` (the block's end).
CODEC_HD void int8_codes(const float* x, int64_t from, int64_t hi, int64_t end, float d, int8_t* q) {
  for (int64_t i = from; i < hi; ++i) q[i] = int8_code(x[i] / d);
  for (int64_t i = hi; i < end; ++i) q[i] = 0;
}

CODEC_HD void fp8_codes(const float* x, int64_t from, int64_t hi, int64_t end, float d, uint8_t* q) {
  for (int64_t i = from; i < hi; ++i) q[i] = e4m3_code(x[i] / d);
  for (int64_t i = hi; i < end; ++i) q[i] = 0;
}

CODEC_HD void int4_codes(const float* x, int64_t from, int64_t hi, int64_t end, float d, uint8_t* q) {
  for (int64_t i = from; i < end; i += 2) q[i / 2] = int4_byte(x, i, hi, d);
}

// Per-range decodes of elements [from, to) of a block with this scale.
CODEC_HD void int8_values(const int8_t* q, int64_t from, int64_t to, float scale, float* out) {
  for (int64_t i = from; i < to; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

CODEC_HD void int4_values(const uint8_t* q, int64_t from, int64_t to, float scale, float* out) {
  for (int64_t i = from; i < to; ++i) out[i] = int4_value(q, i) * scale;
}

// (table: the 256 values of e4m3_to_float, e4m3_decode_table() in codec_fp8_int4.cpp)
CODEC_HD void fp8_values(const uint8_t* q, int64_t from, int64_t to, float scale, const float* table, float* out) {
  for (int64_t i = from; i < to; ++i) out[i] = table[q[i]] * scale;
}

// Threads for nb blocks: none below 64 blocks a thread (a fork costs more than it saves).
inline int codec_threads(int max_threads, int64_t nb) {
  const int64_t by_size = nb / 64 > 1 ? nb / 64 : 1;
  return static_cast<int>(max_threads < by_size ? max_threads : by_size);
}

}  // namespace
}  // namespace cpu
}  // namespace zeroshard
