// Types shared by the torch binding and the per-ISA kernel translation units.
//
// Note [ISA translation units]: adam_avx512.cpp and adam_avx2.cpp enable their instruction
// set with `#pragma GCC target`, so they must not include torch or STL headers: an inline
// function instantiated there (std::min, c10::...) could be picked by the linker for the whole
// library and then execute AVX-512 code on a CPU without it. This header therefore holds only
// plain structs and declarations; everything the kernels inline lives in an anonymous
// namespace inside each ISA file.
#pragma once

#include <stdint.h>

namespace zeroshard {
namespace cpu {

// Element types of the gradient input and of the optional low-precision copy-out.
enum LowpKind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Per-step scalars, precomputed in double by the binding and rounded once to float, the same
// way torch.optim.AdamW's single-tensor path rounds its Python-double scalars.
struct AdamScalars {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;       // Adam (L2) mode: grad += weight_decay * param
  float decay_factor;       // AdamW mode: param *= 1 - lr * weight_decay
  float neg_step_size;      // -lr / (1 - beta1^step)
  float inv_bias_corr2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float grad_scale;         // loss-scale unscale x clip coefficient
  int adamw_mode;
};

// One contiguous span of one tensor; the binding splits tensors into spans per thread.
struct AdamSpan {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out_lowp;  // nullptr when out_kind == kNone
  int64_t numel;
  int grad_kind;   // kF32, kBF16 or kF16
  int out_kind;    // kBF16, kF16 or kNone
};

using AdamSpanFn = void (*)(const AdamSpan&, const AdamScalars&);
// Same-bytes reference sweep: reads 4 fp32 arrays and writes 3, no arithmetic. `mask` is
// always 0 at run time; it only stops the compiler from proving the stores dead.
using SweepFn = void (*)(float*, const float*, float*, float*, int64_t, int mask);

void adam_span_avx512(const AdamSpan& span, const AdamScalars& s);
void adam_span_avx2(const AdamSpan& span, const AdamScalars& s);
void adam_span_scalar(const AdamSpan& span, const AdamScalars& s);
void sweep_avx512(float* p, const float* g, float* m, float* v, int64_t n, int mask);
void sweep_avx2(float* p, const float* g, float* m, float* v, int64_t n, int mask);
void sweep_scalar(float* p, const float* g, float* m, float* v, int64_t n, int mask);

}  // namespace cpu
}  // namespace zeroshard
