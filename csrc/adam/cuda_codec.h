// Host interface of the CUDA block codecs (cuda_codec_kernel.cu). Free of torch headers so the
// .cu compiles with plain nvcc.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace zeroshard {
namespace cuda {

enum CodecKind : int { kCodecInt8 = 0, kCodecFp8 = 1, kCodecInt4 = 2 };

// Encodes n fp32 values into buf ([fp32 scale per block][codes], padded to whole blocks: the
// layout and bytes of the CPU kernels). Returns the launch error, if any.
cudaError_t launch_codec_encode(int kind, const float* x, int64_t n, int64_t block, uint8_t* buf,
                                cudaStream_t stream);

// Decodes the first n values of buf into out (fp32).
cudaError_t launch_codec_decode(int kind, const uint8_t* buf, int64_t n, int64_t block, float* out,
                                cudaStream_t stream);

}  // namespace cuda
}  // namespace zeroshard
