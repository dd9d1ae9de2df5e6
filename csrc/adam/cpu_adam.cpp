// Torch binding of the CPU Adam/AdamW step: validates tensors, picks the instruction set once,
// and splits the work over OpenMP threads in one parallel region per call.
//
// Note [thread split]: all tensors of a call are viewed as one concatenated range, cut into
// 1 MiB-per-stream chunks that the threads of a single parallel region take dynamically. So a
// list of 200 uneven tensors is balanced as well as one big tensor with one fork/join, each
// chunk is a long run that hardware prefetchers follow, and when the OS deschedules one thread
// (the cores are shared) the others keep taking chunks instead of waiting for its fixed half.
//
// Headers: only what this file uses (a tensor, the thread count, the pybind11 casters), not
// torch/extension.h, which pulls in the whole C++ frontend and triples the compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "adam_binding.h"
#include "adam_common.h"

namespace zeroshard {
namespace cpu {
namespace {

// Below this many elements a fork/join costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
constexpr int64_t kChunk = 1 << 18;

struct Isa {
  std::string name;
  AdamSpanFn span;
  SweepFn sweep;
};

bool cpu_has(const std::string& name) {
  __builtin_cpu_init();
  if (name == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  }
  if (name == "avx2") {
    // The AVX2 build also converts fp16 with F16C; every AVX2 CPU to date has it, but check.
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return name == "scalar";
}

Isa isa_by_name(const std::string& name) {
  if (name == "avx512") return {name, adam_span_avx512, sweep_avx512};
  if (name == "avx2") return {name, adam_span_avx2, sweep_avx2};
  return {"scalar", adam_span_scalar, sweep_scalar};
}

Isa best_isa() {
  // ZEROSHARD_CPU_ISA caps the dispatch (for tests and for ruling the kernel out when
  // debugging); it can never select an instruction set the CPU lacks.
  const char* env = std::getenv("ZEROSHARD_CPU_ISA");
  const std::string cap = env ? env : "";
  const bool allow512 = cap.empty() || cap == "avx512";
  const bool allow2 = allow512 || cap == "avx2";
  if (allow512 && cpu_has("avx512")) return isa_by_name("avx512");
  if (allow2 && cpu_has("avx2")) return isa_by_name("avx2");
  return isa_by_name("scalar");
}

Isa& active_isa() {
  static Isa isa = best_isa();
  return isa;
}

int thread_count(int64_t total) {
  const int64_t by_size = std::max<int64_t>(1, total / kMinPerThread);
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), by_size));
}

// Calls fn(tensor_index, begin, end) for every piece of the concatenated range, in chunks
// handed out dynamically; see Note [thread split].
template <class Fn>
void for_each_piece(const std::vector<int64_t>& prefix, int nthreads, Fn fn) {
  const int64_t total = prefix.back();
  const int64_t nchunks = (total + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(total, lo + kChunk);
    size_t k = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
    for (; k + 1 < prefix.size() && prefix[k] < hi; ++k) {
      const int64_t b = std::max(lo, prefix[k]), e = std::min(hi, prefix[k + 1]);
      if (b < e) fn(k, b - prefix[k], e - prefix[k]);
    }
  }
}

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& out_lowps, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool adamw_mode,
               double grad_scale) {
  binding::check_lists(params, grads, exp_avgs, exp_avg_sqs, out_lowps);
  const size_t n = params.size();
  const AdamScalars s =
      binding::make_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
  std::vector<AdamSpan> spans(n);
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(params[i].device().is_cpu(), "zeroshard cpu_adam: tensors must be on CPU, got ",
                params[i].device());
    const int64_t numel = params[i].numel();
    AdamSpan& sp = spans[i];
    sp.param = params[i].data_ptr<float>();
    sp.exp_avg = exp_avgs[i].data_ptr<float>();
    sp.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    sp.grad = grads[i].data_ptr();
    sp.grad_kind = binding::lowp_kind(grads[i], true);
    sp.out_lowp = nullptr;
    sp.out_kind = kNone;
    if (!out_lowps.empty()) {
      sp.out_kind = binding::lowp_kind(out_lowps[i], false);
      sp.out_lowp = out_lowps[i].data_ptr();
    }
    sp.numel = numel;
    prefix[i + 1] = prefix[i] + numel;
  }
  if (prefix.back() == 0) return;
  const AdamSpanFn fn = active_isa().span;
  for_each_piece(prefix, thread_count(prefix.back()), [&](size_t k, int64_t b, int64_t e) {
    const AdamSpan& full = spans[k];
    const int64_t gsize = full.grad_kind == kF32 ? 4 : 2;
    AdamSpan piece = full;
    piece.param = full.param + b;
    piece.exp_avg = full.exp_avg + b;
    piece.exp_avg_sq = full.exp_avg_sq + b;
    piece.grad = static_cast<const char*>(full.grad) + b * gsize;
    piece.out_lowp = full.out_lowp ? static_cast<char*>(full.out_lowp) + b * 2 : nullptr;
    piece.numel = e - b;
    fn(piece, s);
  });
}

// The physical-limit reference for benchmarks: same bytes as the fp32 step, no arithmetic.
void copy_sweep(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v) {
  TORCH_CHECK(p.device().is_cpu(), "zeroshard copy_sweep: tensors must be on CPU, got ", p.device());
  binding::check_tensor(p, p, "p", true);
  binding::check_tensor(g, p, "g", true);
  binding::check_tensor(m, p, "m", true);
  binding::check_tensor(v, p, "v", true);
  const int64_t numel = p.numel();
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const SweepFn fn = active_isa().sweep;
  const std::vector<int64_t> prefix{0, numel};
  // A volatile zero: the compiler cannot prove the blend a no-op and drop the stores.
  static volatile int mask = 0;
  const int mk = mask;
  for_each_piece(prefix, thread_count(numel), [&](size_t, int64_t b, int64_t e) {
    fn(pp + b, gp + b, mp + b, vp + b, e - b, mk);
  });
}

bool set_isa(const std::string& name) {
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar",
              "zeroshard cpu_adam: unknown instruction set '", name,
              "', expected avx512, avx2 or scalar");
  if (!cpu_has(name)) return false;
  active_isa() = isa_by_name(name);
  return true;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* name : {"avx512", "avx2", "scalar"}) {
    if (cpu_has(name)) out.emplace_back(name);
  }
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace zeroshard

namespace zeroshard {
namespace cpu {
double sqnorm_f64_sum(const float* x, int64_t n, int max_threads);  // grad_sqnorm.cpp

at::Tensor sqnorm_f64(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "zeroshard sqnorm_f64: tensor must be on CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "zeroshard sqnorm_f64: expected float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "zeroshard sqnorm_f64: tensor must be contiguous");
  const double total = sqnorm_f64_sum(t.data_ptr<float>(), t.numel(), at::get_num_threads());
  return at::scalar_tensor(total, at::TensorOptions().dtype(at::kDouble));
}

// The block codecs of quantized collectives (codec_int8.cpp, codec_blocks_avx2.cpp, codec_fp8_int4.cpp).
using EncodeFn = void (*)(const float*, int64_t, int64_t, uint8_t*, int);
using DecodeFn = void (*)(const uint8_t*, int64_t, int64_t, float*, int);
void int8_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void int8_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);
void int8_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void int8_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);
void fp8_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void fp8_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);
void fp8_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void fp8_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);
void int4_blocks_encode(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void int4_blocks_decode(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);
void int4_blocks_encode_avx2(const float* x, int64_t n, int64_t block, uint8_t* buf, int max_threads);
void int4_blocks_decode_avx2(const uint8_t* buf, int64_t n, int64_t block, float* out, int max_threads);

// The codecs take their AVX2 builds where the active instruction set (set_isa, ZEROSHARD_CPU_ISA) is not scalar.
static bool codec_avx2() { return active_isa().name != "scalar"; }

template <int64_t kDen>
void encode_with(EncodeFn fn, const char* what, const at::Tensor& x, at::Tensor& buf, int64_t block) {
  binding::check_codec(x, buf, block, kDen, what, c10::DeviceType::CPU);
  fn(x.data_ptr<float>(), x.numel(), block, buf.data_ptr<uint8_t>(), at::get_num_threads());
}

template <int64_t kDen>
void decode_with(DecodeFn fn, const char* what, const at::Tensor& buf, at::Tensor& out, int64_t block) {
  binding::check_codec(out, buf, block, kDen, what, c10::DeviceType::CPU);
  fn(buf.data_ptr<uint8_t>(), out.numel(), block, out.data_ptr<float>(), at::get_num_threads());
}

void int8_encode(const at::Tensor& x, at::Tensor& buf, int64_t block) {
  encode_with<1>(codec_avx2() ? int8_blocks_encode_avx2 : int8_blocks_encode, "int8_encode", x, buf, block);
}
void int8_decode(const at::Tensor& buf, at::Tensor& out, int64_t block) {
  decode_with<1>(codec_avx2() ? int8_blocks_decode_avx2 : int8_blocks_decode, "int8_decode", buf, out, block);
}
void fp8_encode(const at::Tensor& x, at::Tensor& buf, int64_t block) {
  encode_with<1>(codec_avx2() ? fp8_blocks_encode_avx2 : fp8_blocks_encode, "fp8_encode", x, buf, block);
}
void fp8_decode(const at::Tensor& buf, at::Tensor& out, int64_t block) {
  decode_with<1>(codec_avx2() ? fp8_blocks_decode_avx2 : fp8_blocks_decode, "fp8_decode", buf, out, block);
}
void int4_encode(const at::Tensor& x, at::Tensor& buf, int64_t block) {
  encode_with<2>(codec_avx2() ? int4_blocks_encode_avx2 : int4_blocks_encode, "int4_encode", x, buf, block);
}
void int4_decode(const at::Tensor& buf, at::Tensor& out, int64_t block) {
  decode_with<2>(codec_avx2() ? int4_blocks_decode_avx2 : int4_blocks_decode, "int4_decode", buf, out, block);
}
}  // namespace cpu
}  // namespace zeroshard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace zc = zeroshard::cpu;
  using release = py::call_guard<py::gil_scoped_release>;
  m.doc() = "zeroshard fused Adam/AdamW step for CPU (AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("adam_step", &zc::adam_step, release(), py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("out_lowps"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("grad_scale"));
  m.def("copy_sweep", &zc::copy_sweep, release());
  m.def("sqnorm_f64", &zc::sqnorm_f64, release(), py::arg("tensor"));
  m.def("int8_encode", &zc::int8_encode, release(), py::arg("values"), py::arg("buffer"), py::arg("block"));
  m.def("int8_decode", &zc::int8_decode, release(), py::arg("buffer"), py::arg("out"), py::arg("block"));
  m.def("fp8_encode", &zc::fp8_encode, release(), py::arg("values"), py::arg("buffer"), py::arg("block"));
  m.def("fp8_decode", &zc::fp8_decode, release(), py::arg("buffer"), py::arg("out"), py::arg("block"));
  m.def("int4_encode", &zc::int4_encode, release(), py::arg("values"), py::arg("buffer"), py::arg("block"));
  m.def("int4_decode", &zc::int4_decode, release(), py::arg("buffer"), py::arg("out"), py::arg("block"));
  m.def("isa", []() { return zc::active_isa().name; });
  m.def("set_isa", &zc::set_isa, py::arg("name"));
  m.def("supported_isas", &zc::supported_isas);
  m.def("max_threads", []() { return at::get_num_threads(); });
}
