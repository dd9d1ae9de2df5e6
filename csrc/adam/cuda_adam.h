// Host interface of the CUDA multi-tensor Adam kernel (cuda_adam_kernel.cu). Free of torch
// headers so the .cu compiles with plain nvcc.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "adam_common.h"
#include "multi_tensor_plan.h"

namespace zeroshard {
namespace cuda {

// Launches as few kernels as the argument-size limit allows for `n` tensors that share the
// gradient kind and copy-out kind (cpu::LowpKind values). Returns the launch error, if any.
cudaError_t launch_multi_tensor_adam(const TensorRef* refs, int n, int grad_kind, int out_kind,
                                     const cpu::AdamScalars& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace zeroshard
