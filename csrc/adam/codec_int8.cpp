// Block-wise symmetric int8 encode / decode of float32, straight into and out of a collective's
// byte buffer (Note [codec error bounds] in zeroshard/comm/codecs/formats.py): per block of
// `block` elements an fp32 scale a/127 (a: the block's largest magnitude), then
// q = round_half_even(clamp(x / scale, -127, 127)) (scale 0: divide by 1). The same operations
// in the same order as the Python path (zeroshard/comm/codecs/formats.py, Int8Codec), each an
// exactly rounded IEEE operation, so the bytes equal it bit for bit (tests/ops/test_codec_kernel.py);
// blocks are independent, so the result does not depend on the thread count. A block holding
// NaN gets a NaN scale (decoding gives NaN); its codes are unspecified.
//
// No torch headers here (the binding is in cpu_adam.cpp: Note [compile time]).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace zeroshard {
namespace cpu {

void int8_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  uint8_t* scales = buf;
  int8_t* q = reinterpret_cast<int8_t*>(buf + 4 * nb);
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, nb / 64)));
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    float a = 0.0f;
    bool nan = false;
    for (int64_t i = lo; i < hi; ++i) {
      const float v = fabsf(x[i]);
      nan |= v != v;
      a = v > a ? v : a;
    }
    const float scale = nan ? NAN : a / 127.0f;
    memcpy(scales + 4 * b, &scale, 4);
    const float safe = scale > 0.0f ? scale : 1.0f;
    for (int64_t i = lo; i < hi; ++i) {
      float v = x[i] / safe;
      v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
      q[i] = static_cast<int8_t>(nearbyintf(v));
    }
    for (int64_t i = hi; i < lo + block; ++i) q[i] = 0;  // (padding to whole blocks)
  }
}

void int8_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads) {
  const int64_t nb = (n + block - 1) / block;
  const int8_t* q = reinterpret_cast<const int8_t*>(buf + 4 * nb);
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, nb / 64)));
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float scale;
    memcpy(&scale, buf + 4 * b, 4);
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    for (int64_t i = lo; i < hi; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }
}

}  // namespace cpu
}  // namespace zeroshard
