// Portable fp32 <-> bf16/fp16 conversions with round-to-nearest-even, bit-compatible with
// c10::BFloat16 and c10::Half. `static inline` on purpose: see Note [ISA translation units].
#pragma once

#include <stdint.h>
#include <string.h>

namespace zeroshard {
namespace cpu {

static inline uint32_t zs_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float zs_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_float(uint16_t h) { return zs_float(static_cast<uint32_t>(h) << 16); }

static inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;  // c10::BFloat16's canonical NaN
  const uint32_t u = zs_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp16 conversions after the FP16 library (Maratos), which c10::Half also uses.
static inline float f16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = zs_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = zs_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? zs_bits(denormalized) : zs_bits(normalized);
  return zs_float(sign | mag);
}

static inline uint16_t float_to_f16(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = zs_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = zs_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = zs_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace cpu
}  // namespace zeroshard
