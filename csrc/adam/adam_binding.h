// Helpers shared by the CPU and CUDA torch bindings: argument checks and per-step scalars.
// Included only by binding translation units (never by the ISA files, see
// Note [ISA translation units] in adam_common.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#include "adam_common.h"

namespace zeroshard {
namespace binding {

using cpu::AdamScalars;

inline int lowp_kind(const at::Tensor& t, bool allow_f32) {
  if (allow_f32 && t.scalar_type() == at::kFloat) return cpu::kF32;
  if (t.scalar_type() == at::kBFloat16) return cpu::kBF16;
  if (t.scalar_type() == at::kHalf) return cpu::kF16;
  TORCH_CHECK(false, "zeroshard adam: unsupported dtype ", t.scalar_type(),
              allow_f32 ? " for grad (float32, bfloat16 or float16)"
                        : " for out_lowp (bfloat16 or float16)");
}

// A block codec's values (contiguous fp32) and byte buffer (contiguous uint8, large enough for
// [fp32 scale per block][payload]), both on `device_type` (and one device); payload_den:
// elements per payload byte (int4: 2).
inline void check_codec(const at::Tensor& values, const at::Tensor& buf, int64_t block, int64_t payload_den,
                        const char* what, c10::DeviceType device_type) {
  TORCH_CHECK(values.device().type() == device_type && buf.device() == values.device(), "zeroshard ", what,
              ": tensors must be on one ", c10::DeviceTypeName(device_type), " device, got ", values.device(),
              " and ", buf.device());
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous(), "zeroshard ", what,
              ": values must be contiguous float32");
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(), "zeroshard ", what,
              ": the buffer must be contiguous uint8");
  TORCH_CHECK(block >= 2 && block % 2 == 0, "zeroshard ", what, ": block must be even and >= 2, got ", block);
  const int64_t nb = (values.numel() + block - 1) / block;
  const int64_t need = 4 * nb + nb * block / payload_den;
  TORCH_CHECK(buf.numel() >= need, "zeroshard ", what, ": the buffer holds ", buf.numel(), " bytes, ", need, " needed");
}

// Checks one tensor against the param it belongs to: device, contiguity, size and (when
// fp32_only) dtype.
inline void check_tensor(const at::Tensor& t, const at::Tensor& param, const char* what,
                         bool fp32_only) {
  TORCH_CHECK(t.device() == param.device(), "zeroshard adam: ", what, " is on ", t.device(),
              ", param on ", param.device());
  TORCH_CHECK(!fp32_only || t.scalar_type() == at::kFloat, "zeroshard adam: ", what,
              " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "zeroshard adam: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == param.numel(), "zeroshard adam: ", what, " has ", t.numel(),
              " elements, param has ", param.numel());
}

inline void check_lists(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& out_lowps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "zeroshard adam: list lengths differ: params ", n, ", grads ", grads.size(),
              ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size());
  TORCH_CHECK(out_lowps.empty() || out_lowps.size() == n,
              "zeroshard adam: out_lowps must be empty or have ", n, " tensors, got ",
              out_lowps.size());
  for (size_t i = 0; i < n; ++i) {
    check_tensor(params[i], params[i], "param", true);
    check_tensor(exp_avgs[i], params[i], "exp_avg", true);
    check_tensor(exp_avg_sqs[i], params[i], "exp_avg_sq", true);
    check_tensor(grads[i], params[i], "grad", false);
    lowp_kind(grads[i], true);
    if (!out_lowps.empty()) {
      check_tensor(out_lowps[i], params[i], "out_lowp", false);
      lowp_kind(out_lowps[i], false);
    }
  }
}

// Scalars computed in double and rounded once, as torch.optim's single-tensor path does.
inline AdamScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                                double weight_decay, bool adamw_mode, double grad_scale) {
  TORCH_CHECK(step >= 1, "zeroshard adam: step must be >= 1, got ", step);
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.neg_step_size = static_cast<float>(-lr / bc1);
  s.inv_bias_corr2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.grad_scale = static_cast<float>(grad_scale);
  s.adamw_mode = adamw_mode ? 1 : 0;
  return s;
}

}  // namespace binding
}  // namespace zeroshard
