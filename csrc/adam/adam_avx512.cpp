// AVX-512 build of the Adam span kernel. Chosen at run time by cpu_adam.cpp when the CPU
// reports avx512f/bw/vl; see Note [ISA translation units] in adam_common.h for why this file
// includes no torch or STL headers.
#include <immintrin.h>
#include <stdint.h>

#include "adam_common.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// gcc 12 flags the deliberately undefined pass-through operand inside its own AVX-512
// intrinsics (_mm512_undefined_ps) as maybe-uninitialized; it is a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace zeroshard {
namespace cpu {
namespace {

using Vec = __m512;
using VMask = __mmask16;
constexpr int64_t kW = 16;

inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmuladd(Vec a, Vec b, Vec c) { return _mm512_add_ps(_mm512_mul_ps(a, b), c); }  // (not fused: Note [unfused update])
inline Vec vsqrt(Vec a) { return _mm512_sqrt_ps(a); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline VMask vmask_from_int(int m) { return static_cast<VMask>(m ? 0xFFFF : 0); }
inline Vec vselect(VMask k, Vec a, Vec b) { return _mm512_mask_blend_ps(k, b, a); }

inline Vec vload_bf16(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline Vec vload_f16(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

using Low = __m256i;

// Round to nearest even exactly as c10::BFloat16 does, NaN -> 0x7FC0.
inline Low vcvt_bf16(Vec x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline Low vcvt_f16(Vec x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void vstore_low(void* p, Low x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
inline void vstream_low(void* p, Low x) { _mm256_stream_si256(static_cast<__m256i*>(p), x); }
inline void vstream_fence() { _mm_sfence(); }

#include "adam_body.inc"

}  // namespace

void adam_span_avx512(const AdamSpan& a, const AdamScalars& s) { dispatch_span(a, s); }

void sweep_avx512(float* p, const float* g, float* m, float* v, int64_t n, int mask) {
  sweep_impl(p, g, m, v, n, mask);
}

}  // namespace cpu
}  // namespace zeroshard
