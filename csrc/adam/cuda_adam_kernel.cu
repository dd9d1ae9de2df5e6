// CUDA multi-tensor Adam/AdamW: fp32 master params and moments, fp32/bf16/fp16 gradients,
// optional bf16/fp16 copy-out of the updated params, many tensors per launch.
//
// Note [multi-tensor launch]: tensors are cut into kChunk-element chunks; one block handles
// one chunk. The tensor pointers and a block->(tensor, chunk) map travel in the kernel's
// argument buffer (TensorListMeta, < 4 KiB), so a step over hundreds of small tensors costs a
// few launches instead of one per tensor (the apex/torch `multi_tensor_apply` scheme).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_adam.h"

namespace zeroshard {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kILP = 4;

static_assert(sizeof(TensorListMeta) + sizeof(cpu::AdamScalars) <= 4096,
              "kernel arguments must fit the 4 KiB parameter space");

__host__ __device__ __forceinline__ float to_float(float x) { return x; }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__host__ __device__ __forceinline__ T from_float(float x);
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__host__ __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
struct alignas(sizeof(T) * kILP) Pack {
  T v[kILP];
};

// Same operation order as the CPU kernel (adam_body.inc) and torch.optim.AdamW.
template <bool ADAMW>
__host__ __device__ __forceinline__ void adam_elem(float& p, float g, float& m, float& v,
                                          const cpu::AdamScalars& s) {
  g *= s.grad_scale;
  if (!ADAMW) g = fmaf(s.weight_decay, p, g);
  m = fmaf(s.one_minus_beta1, g, s.beta1 * m);
  v = fmaf(s.one_minus_beta2 * g, g, s.beta2 * v);
  const float denom = fmaf(sqrtf(v), s.inv_bias_corr2_sqrt, s.eps);
  if (ADAMW) p *= s.decay_factor;
  p = fmaf(s.neg_step_size, m / denom, p);
}

template <typename T>
__host__ __device__ __forceinline__ bool is_aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * kILP) == 0;
}

// One thread's share of one block's chunk. __host__ too, so that a host program can replay
// the whole grid thread by thread and check it without a GPU (tests/ops/test_ops_cuda_plan.py).
template <typename GT, typename OT, bool HAS_OUT, bool ADAMW>
__host__ __device__ __forceinline__ void adam_thread(const TensorListMeta& meta,
                                                     const cpu::AdamScalars& s, int block,
                                                     int thread, int nthreads) {
  const int t = meta.block_tensor[block];
  const int64_t n = meta.numel[t];
  const int64_t start = static_cast<int64_t>(meta.block_chunk[block]) * kChunk;
  const int64_t end = n < start + kChunk ? n : start + kChunk;
  float* __restrict__ p = meta.param[t];
  const GT* __restrict__ g = static_cast<const GT*>(meta.grad[t]);
  float* __restrict__ m = meta.exp_avg[t];
  float* __restrict__ v = meta.exp_avg_sq[t];
  OT* __restrict__ out = static_cast<OT*>(meta.out[t]);
  // Chunk starts are multiples of kILP, so base-pointer alignment decides for the block.
  const bool vec = is_aligned<float>(p) && is_aligned<float>(m) && is_aligned<float>(v) &&
                   is_aligned<GT>(g) && (!HAS_OUT || is_aligned<OT>(out));
  for (int64_t i = start + static_cast<int64_t>(thread) * kILP; i < end;
       i += static_cast<int64_t>(nthreads) * kILP) {
    if (vec && i + kILP <= end) {
      Pack<float> pp = *reinterpret_cast<const Pack<float>*>(p + i);
      Pack<float> mp = *reinterpret_cast<const Pack<float>*>(m + i);
      Pack<float> vp = *reinterpret_cast<const Pack<float>*>(v + i);
      const Pack<GT> gp = *reinterpret_cast<const Pack<GT>*>(g + i);
      Pack<OT> op;
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        adam_elem<ADAMW>(pp.v[j], to_float(gp.v[j]), mp.v[j], vp.v[j], s);
        if (HAS_OUT) op.v[j] = from_float<OT>(pp.v[j]);
      }
      *reinterpret_cast<Pack<float>*>(p + i) = pp;
      *reinterpret_cast<Pack<float>*>(m + i) = mp;
      *reinterpret_cast<Pack<float>*>(v + i) = vp;
      if (HAS_OUT) *reinterpret_cast<Pack<OT>*>(out + i) = op;
    } else {
      const int64_t stop = end < i + kILP ? end : i + kILP;
      for (int64_t k = i; k < stop; ++k) {
        float pk = p[k], mk = m[k], vk = v[k];
        adam_elem<ADAMW>(pk, to_float(g[k]), mk, vk, s);
        p[k] = pk;
        m[k] = mk;
        v[k] = vk;
        if (HAS_OUT) out[k] = from_float<OT>(pk);
      }
    }
  }
}

template <typename GT, typename OT, bool HAS_OUT, bool ADAMW>
__global__ void __launch_bounds__(kThreads) adam_kernel(TensorListMeta meta, cpu::AdamScalars s) {
  adam_thread<GT, OT, HAS_OUT, ADAMW>(meta, s, blockIdx.x, threadIdx.x, blockDim.x);
}

template <typename GT, typename OT, bool HAS_OUT, bool ADAMW>
cudaError_t launch_all(const TensorRef* refs, int n, const cpu::AdamScalars& s,
                       cudaStream_t stream) {
  TensorListMeta meta;
  cudaError_t err = cudaSuccess;
  // Kernel arguments are copied at launch, so the planner may refill `meta` right after.
  plan_multi_tensor(refs, n, meta, [&](const TensorListMeta& m, int nblocks) {
    adam_kernel<GT, OT, HAS_OUT, ADAMW><<<nblocks, kThreads, 0, stream>>>(m, s);
    err = cudaGetLastError();
    return err == cudaSuccess;
  });
  return err;
}

template <typename GT, typename OT, bool HAS_OUT>
cudaError_t by_mode(const TensorRef* refs, int n, const cpu::AdamScalars& s, cudaStream_t st) {
  return s.adamw_mode ? launch_all<GT, OT, HAS_OUT, true>(refs, n, s, st)
                      : launch_all<GT, OT, HAS_OUT, false>(refs, n, s, st);
}

template <typename GT>
cudaError_t by_out(const TensorRef* refs, int n, int out_kind, const cpu::AdamScalars& s,
                   cudaStream_t st) {
  switch (out_kind) {
    case cpu::kBF16: return by_mode<GT, __nv_bfloat16, true>(refs, n, s, st);
    case cpu::kF16: return by_mode<GT, __half, true>(refs, n, s, st);
    default: return by_mode<GT, __nv_bfloat16, false>(refs, n, s, st);
  }
}

}  // namespace

cudaError_t launch_multi_tensor_adam(const TensorRef* refs, int n, int grad_kind, int out_kind,
                                     const cpu::AdamScalars& s, cudaStream_t stream) {
  switch (grad_kind) {
    case cpu::kBF16: return by_out<__nv_bfloat16>(refs, n, out_kind, s, stream);
    case cpu::kF16: return by_out<__half>(refs, n, out_kind, s, stream);
    default: return by_out<float>(refs, n, out_kind, s, stream);
  }
}

}  // namespace cuda
}  // namespace zeroshard
