// Torch binding of the CUDA multi-tensor Adam/AdamW step (kernel in cuda_adam_kernel.cu), and
// the module that also holds the CUDA block codecs (cuda_codec.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <map>
#include <utility>
#include <vector>

#include "adam_binding.h"
#include "cuda_adam.h"

namespace zeroshard {
namespace cuda {
namespace {

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& out_lowps, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool adamw_mode,
               double grad_scale) {
  binding::check_lists(params, grads, exp_avgs, exp_avg_sqs, out_lowps);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  for (const auto& p : params) {
    TORCH_CHECK(p.is_cuda() && p.device() == device,
                "zeroshard cuda_adam: all tensors must be on one CUDA device; got ", p.device(),
                " and ", device);
  }
  const cpu::AdamScalars s =
      binding::make_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
  // The kernel is templated on gradient and copy-out dtype: one multi-tensor launch per kind.
  std::map<std::pair<int, int>, std::vector<TensorRef>> by_kind;
  for (size_t i = 0; i < params.size(); ++i) {
    const int gk = binding::lowp_kind(grads[i], true);
    const int ok = out_lowps.empty() ? cpu::kNone : binding::lowp_kind(out_lowps[i], false);
    by_kind[{gk, ok}].push_back(TensorRef{
        params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
        exp_avg_sqs[i].data_ptr<float>(), out_lowps.empty() ? nullptr : out_lowps[i].data_ptr(),
        params[i].numel()});
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  for (const auto& kv : by_kind) {
    const cudaError_t err =
        launch_multi_tensor_adam(kv.second.data(), static_cast<int>(kv.second.size()),
                                 kv.first.first, kv.first.second, s, stream);
    TORCH_CHECK(err == cudaSuccess, "zeroshard cuda_adam: kernel launch failed: ",
                cudaGetErrorString(err));
  }
}

}  // namespace

void bind_codecs(pybind11::module_& m);  // cuda_codec.cpp: the block codecs of quantized collectives

}  // namespace cuda
}  // namespace zeroshard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroshard multi-tensor Adam/AdamW step for CUDA";
  m.def("adam_step", &zeroshard::cuda::adam_step, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("out_lowps"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("grad_scale"));
  zeroshard::cuda::bind_codecs(m);
}
