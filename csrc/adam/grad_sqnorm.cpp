// Sum of squares of a float tensor, accumulated in double: the squared L2 norm that gradient
// clipping needs. torch.linalg.vector_norm(g, dtype=torch.float64) converts every element
// through a float64 temporary and runs ~18x slower than the memory allows; this reads the
// floats once.
//
// Note [deterministic sqnorm]: the result must not depend on the thread count (a rerun, a
// resume on a machine with other cores, and every placement must clip by the same bits). So
// the range is cut into fixed blocks of kBlock elements; each block is summed by 8 double
// lanes in element order, the lanes are added in a fixed order, and the block sums are added
// in block order after the parallel loop. Threads only decide who computes which block.
//
// No torch headers here (the tensor checks and the 0-dim result live in the binding,
// cpu_adam.cpp): torch/extension.h alone costs ~40 s of compile time per translation unit.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace zeroshard {
namespace cpu {

namespace {
constexpr int64_t kBlock = 1 << 16;
constexpr int64_t kLanes = 8;

double block_sqsum(const float* x, int64_t n) {
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double v = static_cast<double>(x[i + j]);
      acc[j] += v * v;
    }
  }
  for (int64_t j = 0; i < n; ++i, ++j) {
    const double v = static_cast<double>(x[i]);
    acc[j] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}
}  // namespace

double sqnorm_f64_sum(const float* x, int64_t n, int max_threads) {
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(static_cast<size_t>(nblocks), 0.0);
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, nblocks / 4)));
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock;
    sums[static_cast<size_t>(b)] = block_sqsum(x + lo, std::min(kBlock, n - lo));
  }
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace cpu
}  // namespace zeroshard
