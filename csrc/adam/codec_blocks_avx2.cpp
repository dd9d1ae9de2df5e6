// AVX2 builds of the int8, int4 and fp8 block codecs (codec_int8.cpp and codec_fp8_int4.cpp are
// the portable ones): the same operations on 8 lanes (largest magnitude, an IEEE division by the
// block's divisor, clamp, round half to even, NaN -> 0; int4: + 8, two codes a byte; fp8: c10's
// conversion with its three cases computed on every lane and blended), so the
// bytes and the decoded values equal the portable paths' (and the torch path's) bit for bit;
// tests/ops/test_codec_kernel.py compares them on one CPU through set_isa. A block's tail (past
// the last whole vector) and its padding run the portable per-range loops of codec_common.h. Includes no torch, STL or math.h headers (Note [ISA translation units] in adam_common.h).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "codec_common.h"

#pragma GCC target("avx2,fma,f16c")

namespace zeroshard {
namespace cpu {
namespace {

inline float block_scale_avx2(const float* x, int64_t lo, int64_t hi, float qmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, v);  // (exact: the order of a max does not matter)
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, amax);
  float a = 0.0f;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int k = 0; k < 8; ++k) a = lanes[k] > a ? lanes[k] : a;
  absmax_range(x, i, hi, a, has_nan);
  return scale_of(a, has_nan, qmax);
}

// 8 codes round(clamp(x / d, -qmax, qmax)) + bias as int32 (a NaN's code: 0).
inline __m256i codes8(const float* x, __m256 d, float qmax, float bias) {
  const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x), d);
  const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-qmax)), _mm256_set1_ps(qmax));
  const __m256 r = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_and_ps(_mm256_add_ps(r, _mm256_set1_ps(bias)), ordered));
}

// 32 codes of x[0..32) as 32 bytes in order (4 x 8 int32 packed with saturation, then the
// 4-byte groups the packs interleave across lanes put back).
inline __m256i codes32(const float* x, __m256 d, float qmax, float bias) {
  const __m256i p01 = _mm256_packs_epi32(codes8(x, d, qmax, bias), codes8(x + 8, d, qmax, bias));
  const __m256i p23 = _mm256_packs_epi32(codes8(x + 16, d, qmax, bias), codes8(x + 24, d, qmax, bias));
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 e4m3fn codes of clamp(x / d, -448, 448), as codec_common.h's e4m3_code (a NaN
// passes the clamp with its sign, as there), in the low byte of each int32 lane.
inline __m256i e4m3_codes8(const float* x, __m256 d) {
  const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x), d);
  __m256 c = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-448.0f)), _mm256_set1_ps(448.0f));
  c = _mm256_blendv_ps(c, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i bits = _mm256_castps_si256(c);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);  // (|c|'s bits: compared as signed, they order as unsigned)
  const __m256i big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((1087 << 20) - 1));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  const __m256i r_big = _mm256_blendv_epi8(_mm256_set1_epi32(0x7E), _mm256_set1_epi32(0x7F), nan);
  const __m256i denorm = _mm256_set1_epi32(141 << 23);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
  const __m256i r_small = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu));
  __m256i r_norm = _mm256_and_si256(_mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 20),
                                    _mm256_set1_epi32(0xFF));
  r_norm = _mm256_blendv_epi8(r_norm, _mm256_set1_epi32(0x7E), _mm256_cmpeq_epi32(r_norm, _mm256_set1_epi32(0x7F)));
  const __m256i r = _mm256_blendv_epi8(_mm256_blendv_epi8(r_norm, r_small, small), r_big, big);
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

}  // namespace

void int8_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  int8_t* q = reinterpret_cast<int8_t*>(buf + 4 * nb);
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale_avx2(x, lo, hi, 127.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    const __m256 dv = _mm256_set1_ps(d);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), codes32(x + i, dv, 127.0f, 0.0f));
    }
    int8_codes(x, i, hi, lo + block, d, q);  // (the tail, then padding to whole blocks)
  }
}

void int8_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const int8_t* q = reinterpret_cast<const int8_t*>(buf + 4 * nb);
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const __m256 sv = _mm256_set1_ps(scale);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv));
    }
    int8_values(q, i, hi, scale, out);
  }
}

void int4_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  uint8_t* q = buf + 4 * nb;  // (block is even: a byte's two codes are of one block)
  const __m256i low4 = _mm256_set1_epi16(0x0F), high4 = _mm256_set1_epi16(0xF0);
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale_avx2(x, lo, hi, 7.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    const __m256 dv = _mm256_set1_ps(d);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {  // (byte pairs as 16-bit lanes: low | high << 4, then packed)
      const __m256i w = codes32(x + i, dv, 7.0f, 8.0f);
      const __m256i two = _mm256_or_si256(_mm256_and_si256(w, low4), _mm256_and_si256(_mm256_srli_epi16(w, 4), high4));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(two, two), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i / 2), _mm256_castsi256_si128(packed));
    }
    int4_codes(x, i, hi, lo + block, d, q);
  }
}

void int4_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const uint8_t* q = buf + 4 * nb;
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const __m256 sv = _mm256_set1_ps(scale);
    const __m256i eight = _mm256_set1_epi32(8), low4 = _mm256_set1_epi32(0x0F);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {  // (8 bytes: low nibbles and high ones interleaved back)
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i / 2)));
      const __m256i c0 = _mm256_sub_epi32(_mm256_and_si256(bytes, low4), eight);
      const __m256i c1 = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight);
      const __m256i a = _mm256_unpacklo_epi32(c0, c1), z = _mm256_unpackhi_epi32(c0, c1);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, z, 0x20)), sv));
      _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, z, 0x31)), sv));
    }
    int4_values(q, i, hi, scale, out);
  }
}

const float* e4m3_decode_table();  // codec_fp8_int4.cpp

void fp8_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  uint8_t* q = buf + 4 * nb;
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale_avx2(x, lo, hi, 448.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    const __m256 dv = _mm256_set1_ps(d);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {  // (codes 0..255: packed without saturating, then put back in order)
      const __m256i p01 = _mm256_packus_epi32(e4m3_codes8(x + i, dv), e4m3_codes8(x + i + 8, dv));
      const __m256i p23 = _mm256_packus_epi32(e4m3_codes8(x + i + 16, dv), e4m3_codes8(x + i + 24, dv));
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p01, p23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
    }
    fp8_codes(x, i, hi, lo + block, d, q);
  }
}

void fp8_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const uint8_t* q = buf + 4 * nb;
  const float* table = e4m3_decode_table();
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const __m256 sv = _mm256_set1_ps(scale);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(table, idx, 4), sv));
    }
    fp8_values(q, i, hi, scale, table, out);
  }
}

}  // namespace cpu
}  // namespace zeroshard
