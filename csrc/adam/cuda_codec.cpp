// Torch binding of the CUDA block codecs (kernels in cuda_codec_kernel.cu): the CPU binding's
// functions (cpu_adam.cpp: int8/fp8/int4 _encode/_decode, same arguments, same checks) for
// tensors on one CUDA device, launched on its current stream. Registered into the CUDA Adam
// module by cuda_adam.cpp, so a CUDA build of torch builds and loads both at once.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "adam_binding.h"
#include "cuda_codec.h"

namespace zeroshard {
namespace cuda {
namespace {

// Elements per payload byte of each CodecKind (int4: two).
constexpr int64_t kPerByte[] = {1, 1, 2};
const char* const kEncodeName[] = {"int8_encode", "fp8_encode", "int4_encode"};
const char* const kDecodeName[] = {"int8_decode", "fp8_decode", "int4_decode"};

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

template <int KIND>
void encode(const at::Tensor& x, at::Tensor& buf, int64_t block) {
  binding::check_codec(x, buf, block, kPerByte[KIND], kEncodeName[KIND], c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = launch_codec_encode(KIND, x.data_ptr<float>(), x.numel(), block,
                                              buf.data_ptr<uint8_t>(), stream_of(x));
  TORCH_CHECK(err == cudaSuccess, "zeroshard ", kEncodeName[KIND], ": kernel launch failed: ", cudaGetErrorString(err));
}

template <int KIND>
void decode(const at::Tensor& buf, at::Tensor& out, int64_t block) {
  binding::check_codec(out, buf, block, kPerByte[KIND], kDecodeName[KIND], c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaError_t err = launch_codec_decode(KIND, buf.data_ptr<uint8_t>(), out.numel(), block,
                                              out.data_ptr<float>(), stream_of(out));
  TORCH_CHECK(err == cudaSuccess, "zeroshard ", kDecodeName[KIND], ": kernel launch failed: ", cudaGetErrorString(err));
}

template <int KIND>
void bind(pybind11::module_& m) {
  m.def(kEncodeName[KIND], &encode<KIND>, pybind11::arg("values"), pybind11::arg("buffer"), pybind11::arg("block"));
  m.def(kDecodeName[KIND], &decode<KIND>, pybind11::arg("buffer"), pybind11::arg("out"), pybind11::arg("block"));
}

}  // namespace

void bind_codecs(pybind11::module_& m) {
  bind<kCodecInt8>(m);
  bind<kCodecFp8>(m);
  bind<kCodecInt4>(m);
}

}  // namespace cuda
}  // namespace zeroshard
