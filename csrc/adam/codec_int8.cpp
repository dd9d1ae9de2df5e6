// Block-wise symmetric int8 encode / decode of float32, straight into and out of a collective's
// byte buffer (Note [codec error bounds] in zeroshard/comm/codecs/codec_formats.py): per block of
// `block` elements an fp32 scale a/127 (codec_common.h), then
// q = round_half_even(clamp(x / divisor, -127, 127)). The same operations in the same order as
// the Python path (Int8Codec), each an exactly rounded IEEE operation, so the bytes equal it bit
// for bit (tests/ops/test_codec_kernel.py); blocks are independent, so the result does not
// depend on the thread count. A NaN's code is 0 (what torch's float -> int8 conversion gives on
// x86); a block holding inf or NaN has a non-finite scale and decodes to NaN.
//
// This is the portable path; codec_blocks_avx2.cpp is the AVX2 one, equal to it byte for byte
// (the binding picks it where the CPU has AVX2 and ZEROSHARD_CPU_ISA allows it), and
// cuda_codec_kernel.cu the CUDA one; all three run the per-element code of codec_common.h.
// No torch headers here (the binding is in cpu_adam.cpp: Note [compile time]).
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "codec_common.h"

namespace zeroshard {
namespace cpu {

void int8_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  int8_t* q = reinterpret_cast<int8_t*>(buf + 4 * nb);
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = block_scale(x, lo, hi, 127.0f);
    memcpy(buf + 4 * b, &scale, 4);
    const float d = divisor_of(scale);
    int8_codes(x, lo, hi, lo + block, d, q);  // (padding to whole blocks)
  }
}

void int8_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const int8_t* q = reinterpret_cast<const int8_t*>(buf + 4 * nb);
#pragma omp parallel for num_threads(codec_threads(max_threads, nb)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    int8_values(q, lo, hi, scale, out);
  }
}

}  // namespace cpu
}  // namespace zeroshard
