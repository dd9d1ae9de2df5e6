// Portable scalar build of the Adam span kernel, for CPUs without AVX2/FMA. Same arithmetic
// as the vector builds, bit for bit (Note [unfused update] in adam_body.inc).
#include <math.h>
#include <stdint.h>

#include "adam_common.h"
#include "lowp_scalar.h"

namespace zeroshard {
namespace cpu {
namespace {

using Vec = float;
using VMask = uint32_t;
constexpr int64_t kW = 1;

inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec x) { *p = x; }
inline Vec vset1(float x) { return x; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vmuladd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vsqrt(Vec a) { return sqrtf(a); }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
inline VMask vmask_from_int(int m) { return m ? 0xFFFFFFFFu : 0u; }
// Bitwise select, so that a mask of 0 cannot be proven at compile time to skip the stores.
inline Vec vselect(VMask k, Vec a, Vec b) { return zs_float((zs_bits(a) & k) | (zs_bits(b) & ~k)); }
inline Vec vload_bf16(const void* p) { return bf16_to_float(*static_cast<const uint16_t*>(p)); }
inline Vec vload_f16(const void* p) { return f16_to_float(*static_cast<const uint16_t*>(p)); }
using Low = uint16_t;
inline Low vcvt_bf16(Vec x) { return float_to_bf16(x); }
inline Low vcvt_f16(Vec x) { return float_to_f16(x); }
inline void vstore_low(void* p, Low x) { *static_cast<uint16_t*>(p) = x; }
inline void vstream_low(void* p, Low x) { vstore_low(p, x); }  // never chosen: kW == 1
inline void vstream_fence() {}

#include "adam_body.inc"

}  // namespace

void adam_span_scalar(const AdamSpan& a, const AdamScalars& s) { dispatch_span(a, s); }

void sweep_scalar(float* p, const float* g, float* m, float* v, int64_t n, int mask) {
  sweep_impl(p, g, m, v, n, mask);
}

}  // namespace cpu
}  // namespace zeroshard
