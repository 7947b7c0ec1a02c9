// AdamW kernels (train/cuda/adamw.cuh). The update is the CPU's formula element by element in FP64
// with the round-to-nearest intrinsics (__dmul_rn, __dadd_rn, ...), which nvcc never fuses into an
// FMA, so the results equal the CPU's bit for bit. The norm's block sums run one thread per block
// of elements, adding the squares in element order as the CPU does.
#include <cuda_runtime.h>

#include <cstring>

#include "ops/cuda/layer_ops_common.cuh"
#include "train/cuda/adamw.cuh"

namespace hlm::train::cuda {
namespace {

using ops::cuda::check_launch;

constexpr int kThreads = 256;

// One gradient-norm block: elements [begin, end) of an f32 or f64 array.
struct NormBlock {
  const void* p;
  int64_t begin, end;
  int64_t f64;
};

// A warp per block. Each pass loads 256 elements (lane l holds begin + c + l + 32 j in v[j],
// coalesced) and adds their squares in element order: element 32 j + l comes from lane l by a
// shuffle, so every lane runs the CPU's sequential sum.
__global__ void block_sum_squares_kernel(const NormBlock* blocks, int64_t nblocks, double* out) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x & 31);
  if (w >= nblocks) return;  // the whole warp
  const NormBlock b = blocks[w];
  double s = 0;
  for (int64_t c = b.begin; c < b.end; c += 256) {
    double v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = c + lane + 32 * j;
      v[j] = i >= b.end ? 0.0
             : b.f64    ? static_cast<const double*>(b.p)[i]
                        : double(static_cast<const float*>(b.p)[i]);
    }
    const int64_t cnt = b.end - c < 256 ? b.end - c : 256;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        const double x = __shfl_sync(0xffffffffu, v[j], l);
        if (32 * j + l < cnt) s = __dadd_rn(s, __dmul_rn(x, x));
      }
  }
  if (lane == 0) out[w] = s;
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

std::vector<double> block_sum_squares(const std::vector<const Tensor*>& gs, int64_t block) {
  std::vector<NormBlock> blocks;
  for (const Tensor* g : gs)
    for (int64_t b = 0; b < g->numel(); b += block)
      blocks.push_back({g->raw(), b, b + block < g->numel() ? b + block : g->numel(),
                        g->dtype() == DType::f64 ? 1 : 0});
  const int64_t nb = int64_t(blocks.size());
  if (nb == 0) return {};
  static_assert(sizeof(NormBlock) % sizeof(int64_t) == 0, "the table travels as i64 words");
  const int64_t words = nb * int64_t(sizeof(NormBlock) / sizeof(int64_t));
  std::vector<int64_t> table(static_cast<size_t>(words));
  std::memcpy(table.data(), blocks.data(), size_t(words) * sizeof(int64_t));
  const Tensor dtable = Tensor::from_vector<int64_t>({words}, table).to(Device::cuda);
  Tensor out = Tensor::empty({nb}, DType::f64, Device::cuda);
  const int64_t warps_per_block = kThreads / 32;
  block_sum_squares_kernel<<<unsigned((nb + warps_per_block - 1) / warps_per_block), kThreads>>>(
      static_cast<const NormBlock*>(dtable.raw()), nb, static_cast<double*>(out.raw()));
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
