// AVX2+FMA+F16C build of the Adam span kernel. See Note [ISA translation units] in
// adam_common.h for why this file includes no torch or STL headers.
#include <immintrin.h>
#include <stdint.h>

#include "adam_common.h"

#pragma GCC target("avx2,fma,f16c")

namespace zeroshard {
namespace cpu {
namespace {

using Vec = __m256;
using VMask = __m256;
constexpr int64_t kW = 8;

inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmuladd(Vec a, Vec b, Vec c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }  // (not fused: Note [unfused update])
inline Vec vsqrt(Vec a) { return _mm256_sqrt_ps(a); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline VMask vmask_from_int(int m) { return _mm256_castsi256_ps(_mm256_set1_epi32(m ? -1 : 0)); }
inline Vec vselect(VMask k, Vec a, Vec b) { return _mm256_blendv_ps(b, a, k); }

inline Vec vload_bf16(const void* p) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline Vec vload_f16(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

using Low = __m128i;

// Round to nearest even exactly as c10::BFloat16 does, NaN -> 0x7FC0.
inline Low vcvt_bf16(Vec x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
  r = _mm256_srli_epi32(r, 16);
  // packus saturates to uint16, which is exact here: every lane is <= 0xFFFF after the shift.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline Low vcvt_f16(Vec x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void vstore_low(void* p, Low x) { _mm_storeu_si128(static_cast<__m128i*>(p), x); }
inline void vstream_low(void* p, Low x) { _mm_stream_si128(static_cast<__m128i*>(p), x); }
inline void vstream_fence() { _mm_sfence(); }

#include "adam_body.inc"

}  // namespace

void adam_span_avx2(const AdamSpan& a, const AdamScalars& s) { dispatch_span(a, s); }

void sweep_avx2(float* p, const float* g, float* m, float* v, int64_t n, int mask) {
  sweep_impl(p, g, m, v, n, mask);
}

}  // namespace cpu
}  // namespace zeroshard
