// CUDA block codecs (int8, fp8 e4m3fn, int4) of fp32, straight into and out of a collective's
// byte buffer: the layout, the bytes and the decoded values of the CPU kernels
// (codec_int8.cpp, codec_fp8_int4.cpp), because every element goes through the same functions
// of codec_common.h (its per-range loops, over one element or one int4 pair here).
//
// Note [CUDA codec phases]: an encode is two launches on one stream. The first computes each
// block's scale (one thread a block: the largest magnitude is exact in any order, but a
// reduction across threads would need shared memory and barriers, which a host replay cannot
// run) and writes it into the buffer's head; the second writes one payload byte per thread
// (int4: a pair of elements), reading its block's scale back from the buffer. A decode is one
// launch, one element per thread. Grid-stride loops, so any size fits a bounded grid. Every
// thread's body is __host__ __device__: tests/ops/test_cuda_codec_replay.py compiles this file
// with nvcc and replays the whole grid on the host CPU, without a GPU.
#include "codec_common.h"
#include "cuda_codec.h"

namespace zeroshard {
namespace cuda {
namespace {

constexpr int kCodecThreads = 256;
constexpr int64_t kCodecMaxBlocks = 1 << 16;

// Blocks of kCodecThreads for `units` work items, at most max_blocks (then threads stride).
inline int codec_grid(int64_t units, int64_t max_blocks) {
  const int64_t need = (units + kCodecThreads - 1) / kCodecThreads;
  return static_cast<int>(need < 1 ? 1 : (need < max_blocks ? need : max_blocks));
}

CODEC_HD float load_scale(const uint8_t* buf, int64_t b) {
  float s;
  memcpy(&s, buf + 4 * b, 4);  // (the buffer may be a byte slice: no alignment assumed)
  return s;
}

// Per codec: qmax, elements per payload byte, the byte of the unit at element i (codes of
// x / d, padding past n), and the value of element i before its block's scale.
template <int KIND>
struct Codec;

template <>
struct Codec<kCodecInt8> {
  static constexpr float kQmax = 127.0f;
  static constexpr int kPerByte = 1;
  static CODEC_HD void code(const float* x, int64_t i, int64_t n, float d, uint8_t* q) {
    cpu::int8_codes(x, i, i < n ? i + 1 : i, i + 1, d, reinterpret_cast<int8_t*>(q));
  }
  static CODEC_HD void value(const uint8_t* q, int64_t i, float scale, float* out) {
    cpu::int8_values(reinterpret_cast<const int8_t*>(q), i, i + 1, scale, out);
  }
};

template <>
struct Codec<kCodecFp8> {
  static constexpr float kQmax = 448.0f;
  static constexpr int kPerByte = 1;
  static CODEC_HD void code(const float* x, int64_t i, int64_t n, float d, uint8_t* q) {
    cpu::fp8_codes(x, i, i < n ? i + 1 : i, i + 1, d, q);
  }
  // (c10's conversion itself: the CPU kernels' 256-entry table holds exactly its values)
  static CODEC_HD void value(const uint8_t* q, int64_t i, float scale, float* out) {
    out[i] = cpu::e4m3_to_float(q[i]) * scale;
  }
};

template <>
struct Codec<kCodecInt4> {
  static constexpr float kQmax = 7.0f;
  static constexpr int kPerByte = 2;
  static CODEC_HD void code(const float* x, int64_t i, int64_t n, float d, uint8_t* q) {
    cpu::int4_codes(x, i, n, i + 2, d, q);
  }
  static CODEC_HD void value(const uint8_t* q, int64_t i, float scale, float* out) {
    cpu::int4_values(q, i, i + 1, scale, out);
  }
};

// Encode, first launch: the scales of blocks first, first + stride, ...
template <int KIND>
CODEC_HD void scale_thread(const float* x, int64_t n, int64_t block, uint8_t* buf, int64_t first, int64_t stride) {
  const int64_t nb = (n + block - 1) / block;
  for (int64_t b = first; b < nb; b += stride) {
    const int64_t lo = b * block, hi = n < lo + block ? n : lo + block;
    const float scale = cpu::block_scale(x, lo, hi, Codec<KIND>::kQmax);
    memcpy(buf + 4 * b, &scale, 4);
  }
}

// Encode, second launch: payload bytes first, first + stride, ... (padding included).
template <int KIND>
CODEC_HD void code_thread(const float* x, int64_t n, int64_t block, uint8_t* buf, int64_t first, int64_t stride) {
  const int64_t nb = (n + block - 1) / block;
  const int64_t bytes = nb * block / Codec<KIND>::kPerByte;
  uint8_t* q = buf + 4 * nb;
  for (int64_t u = first; u < bytes; u += stride) {
    const int64_t i = u * Codec<KIND>::kPerByte;
    Codec<KIND>::code(x, i, n, cpu::divisor_of(load_scale(buf, i / block)), q);
  }
}

template <int KIND>
CODEC_HD void decode_thread(const uint8_t* buf, int64_t n, int64_t block, float* out, int64_t first, int64_t stride) {
  const int64_t nb = (n + block - 1) / block;
  const uint8_t* q = buf + 4 * nb;
  for (int64_t i = first; i < n; i += stride) Codec<KIND>::value(q, i, load_scale(buf, i / block), out);
}

__device__ __forceinline__ int64_t first_thread() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <int KIND>
__global__ void __launch_bounds__(kCodecThreads) scale_kernel(const float* x, int64_t n, int64_t block, uint8_t* buf) {
  scale_thread<KIND>(x, n, block, buf, first_thread(), grid_threads());
}

template <int KIND>
__global__ void __launch_bounds__(kCodecThreads) code_kernel(const float* x, int64_t n, int64_t block, uint8_t* buf) {
  code_thread<KIND>(x, n, block, buf, first_thread(), grid_threads());
}

template <int KIND>
__global__ void __launch_bounds__(kCodecThreads) decode_kernel(const uint8_t* buf, int64_t n, int64_t block, float* out) {
  decode_thread<KIND>(buf, n, block, out, first_thread(), grid_threads());
}

// The two operations as launchers by codec (one stream; n == 0 launches nothing).
template <int KIND>
struct Encode {
  static cudaError_t run(const float* x, int64_t n, int64_t block, uint8_t* buf, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    const int64_t nb = (n + block - 1) / block;
    // (same stream: the second launch starts after the first has written every scale)
    scale_kernel<KIND><<<codec_grid(nb, kCodecMaxBlocks), kCodecThreads, 0, stream>>>(x, n, block, buf);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const int64_t bytes = nb * block / Codec<KIND>::kPerByte;
    code_kernel<KIND><<<codec_grid(bytes, kCodecMaxBlocks), kCodecThreads, 0, stream>>>(x, n, block, buf);
    return cudaGetLastError();
  }
};

template <int KIND>
struct Decode {
  static cudaError_t run(const uint8_t* buf, int64_t n, int64_t block, float* out, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    decode_kernel<KIND><<<codec_grid(n, kCodecMaxBlocks), kCodecThreads, 0, stream>>>(buf, n, block, out);
    return cudaGetLastError();
  }
};

template <template <int> class Op, typename... Args>
cudaError_t by_kind(int kind, Args... args) {
  switch (kind) {
    case kCodecInt8: return Op<kCodecInt8>::run(args...);
    case kCodecFp8: return Op<kCodecFp8>::run(args...);
    case kCodecInt4: return Op<kCodecInt4>::run(args...);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_codec_encode(int kind, const float* x, int64_t n, int64_t block, uint8_t* buf,
                                cudaStream_t stream) {
  return by_kind<Encode>(kind, x, n, block, buf, stream);
}

cudaError_t launch_codec_decode(int kind, const uint8_t* buf, int64_t n, int64_t block, float* out,
                                cudaStream_t stream) {
  return by_kind<Decode>(kind, buf, n, block, out, stream);
}

}  // namespace cuda
}  // namespace zeroshard
