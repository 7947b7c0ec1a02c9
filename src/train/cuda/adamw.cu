// AdamW kernels (train/cuda/adamw.cuh). The update is the CPU's formula element by element in FP64
// with the round-to-nearest intrinsics (__dmul_rn, __dadd_rn, ...), which nvcc never fuses into an
// FMA, so the results equal the CPU's bit for bit. The norm's block sums run one thread per block
// of elements, adding the squares in element order as the CPU does.
#include <cuda_runtime.h>

#include "ops/cuda/layer_ops_common.cuh"
#include "train/cuda/adamw.cuh"

namespace hlm::train::cuda {
namespace {

using ops::cuda::check_launch;

constexpr int kThreads = 256;

template <class G>
__global__ void block_sum_squares_kernel(const G* g, int64_t n, int64_t block, int64_t nblocks,
                                         double* out) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const int64_t begin = b * block, end = begin + block < n ? begin + block : n;
  double s = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double x = double(g[i]);
    s = __dadd_rn(s, __dmul_rn(x, x));
  }
  out[b] = s;
}

template <class M, class G>
__global__ void adamw_kernel(M* w, M* m, M* v, const G* g, int64_t n, double scale, double b1,
                             double b2, double decay_mul, double lr, double bc1, double bc2,
                             double eps) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const double gi = __dmul_rn(double(g[i]), scale);
  const M mi = M(__dadd_rn(__dmul_rn(b1, double(m[i])), __dmul_rn(__dadd_rn(1.0, -b1), gi)));
  const M vi =
      M(__dadd_rn(__dmul_rn(b2, double(v[i])), __dmul_rn(__dmul_rn(__dadd_rn(1.0, -b2), gi), gi)));
  m[i] = mi;
  v[i] = vi;
  double wi = __dmul_rn(double(w[i]), decay_mul);
  const double denom = __dadd_rn(__dsqrt_rn(__ddiv_rn(double(vi), bc2)), eps);
  wi = __dadd_rn(wi, -__ddiv_rn(__dmul_rn(lr, __ddiv_rn(double(mi), bc1)), denom));
  w[i] = M(wi);
}

template <class M, class G>
void launch_update(Tensor& w, Tensor& m, Tensor& v, const Tensor& g, double scale, double b1,
                   double b2, double decay_mul, double lr, double bc1, double bc2, double eps) {
  const int64_t n = w.numel();
  if (n == 0) return;
  adamw_kernel<M, G><<<unsigned((n + kThreads - 1) / kThreads), kThreads>>>(
      static_cast<M*>(w.raw()), static_cast<M*>(m.raw()), static_cast<M*>(v.raw()),
      static_cast<const G*>(g.raw()), n, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
  check_launch("AdamW update");
}

}  // namespace

std::vector<double> block_sum_squares(const Tensor& g, int64_t block) {
  const int64_t n = g.numel(), nb = (n + block - 1) / block;
  if (nb == 0) return {};
  Tensor out = Tensor::empty({nb}, DType::f64, Device::cuda);
  const unsigned grid = unsigned((nb + kThreads - 1) / kThreads);
  if (g.dtype() == DType::f64)
    block_sum_squares_kernel<double><<<grid, kThreads>>>(
        static_cast<const double*>(g.raw()), n, block, nb, static_cast<double*>(out.raw()));
  else
    block_sum_squares_kernel<float><<<grid, kThreads>>>(static_cast<const float*>(g.raw()), n,
                                                        block, nb, static_cast<double*>(out.raw()));
  check_launch("AdamW gradient norm");
  return out.to_f64_vector();
}

void adamw_update(Tensor& w, Tensor& m, Tensor& v, const Tensor& g, double scale, double b1,
                  double b2, double decay_mul, double lr, double bc1, double bc2, double eps) {
  const bool g64 = g.dtype() == DType::f64;
  if (w.dtype() == DType::f64) {
    if (g64)
      launch_update<double, double>(w, m, v, g, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
    else
      launch_update<double, float>(w, m, v, g, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
  } else {
    if (g64)
      launch_update<float, double>(w, m, v, g, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
    else
      launch_update<float, float>(w, m, v, g, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
  }
}

}  // namespace hlm::train::cuda
