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
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "codec_common.h"

namespace zeroshard {
namespace cpu {
namespace {

struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_float(static_cast<uint8_t>(i));
  }
};

}  // namespace

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
    fp8_codes(x, lo, hi, lo + block, d, q);
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
    fp8_values(q, lo, hi, scale, table, out);
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
    int4_codes(x, lo, hi, lo + block, d, q);
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
    int4_values(q, lo, hi, scale, out);
  }
}

}  // namespace cpu
}  // namespace zeroshard
