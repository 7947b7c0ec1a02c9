// The Hadamard rotation on CUDA (ops/cuda/hadamard.cuh), the math of ops/cpu/hadamard.cpp:
//   per row of d (a power of two): butterflies (a, b) -> (a + b, a - b) of stride 1, 2, 4, ...,
//   d / 2, then every element times 1 / sqrt(d) (rounded to the computation dtype A). Every
//   element goes through the same additions in the same order as on the CPU, so f32 / f64 results
//   are bit-identical to the reference (and run to run).
// d <= 1024, register kernel: a row belongs to a group of G = min(d, 32) lanes of one warp (32 / G
//   rows per warp, 256-thread blocks); lane g of the group holds the E = d / G consecutive
//   elements [g E, g E + E) in registers. Strides < E are butterflies inside the lane; a stride
//   s >= E pairs lane g with lane g ^ (s / E) (__shfl_xor_sync): the lower lane keeps a + b, the
//   upper one a - b, a being the lower lane's element. No shared memory, no block sync.
// d > 1024, shared-memory kernel: one 256-thread block per row; the row is loaded (coalesced) into
//   shared memory, each stage's d / 2 butterflies are spread over the threads, with a block sync
//   between stages (so the race check sees no overlap), then scaled and stored (coalesced).
// Faster: the register kernel's loads are lane-strided (E consecutive elements per lane); 16-byte
// vector loads, or a lane-interleaved layout with the stage order remapped, would coalesce them.
// The shared-memory kernel could do its first log2(d / 256) stages in registers and only the
// last ones through shared memory; the op is memory bound (d log d adds per d loads / stores).
#include "ops/cuda/hadamard.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRegMaxD = 1024;

template <int E, class T>
__global__ void __launch_bounds__(kThreads)
    hadamard_reg_kernel(const T* x, T* y, int64_t rows, int G, acc_t<T> norm) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31, g = lane % G;
  const int64_t row = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / G;
  const bool live = row < rows;
  const int64_t base = row * int64_t(G) * E + int64_t(g) * E;
  A v[E];
#pragma unroll
  for (int k = 0; k < E; ++k) v[k] = live ? ld<A>(x, base + k) : A(0);
#pragma unroll
  for (int len = 1; len < E; len <<= 1)
#pragma unroll
    for (int i = 0; i < E; i += 2 * len)
#pragma unroll
      for (int j = i; j < i + len; ++j) {
        const A a = v[j], b = v[j + len];
        v[j] = a + b;
        v[j + len] = a - b;
      }
  for (int m = 1; m < G; m <<= 1) {
    const bool upper = (g & m) != 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const A o = __shfl_xor_sync(0xffffffffu, v[k], m);
      v[k] = upper ? o - v[k] : v[k] + o;
    }
  }
  if (!live) return;
#pragma unroll
  for (int k = 0; k < E; ++k) st(y, base + k, v[k] * norm);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    hadamard_smem_kernel(const T* x, T* y, int64_t d, acc_t<T> norm) {
  using A = acc_t<T>;
  extern __shared__ float4 smem4[];
  A* s = reinterpret_cast<A*>(smem4);
  const int64_t base = int64_t(blockIdx.x) * d;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) s[j] = ld<A>(x, base + j);
  __syncthreads();
  for (int64_t len = 1; len < d; len <<= 1) {
    for (int64_t q = threadIdx.x; q < d / 2; q += kThreads) {
      const int64_t j = (q / len) * 2 * len + q % len;
      const A a = s[j], b = s[j + len];
      s[j] = a + b;
      s[j + len] = a - b;
    }
    __syncthreads();
  }
  for (int64_t j = threadIdx.x; j < d; j += kThreads) st(y, base + j, s[j] * norm);
}

template <int E, class T>
void launch_reg(const T* x, T* y, int64_t rows, int64_t d, acc_t<T> norm) {
  const int G = int(d / E);
  hadamard_reg_kernel<E, T><<<blocks_for(rows * G, kThreads), kThreads>>>(x, y, rows, G, norm);
}

}  // namespace

void hadamard(const Tensor& x, Tensor& y) {
  const int64_t d = x.size(-1), rows = d > 0 ? x.numel() / d : 0;
  if (rows == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    const A norm = A(1.0 / std::sqrt(double(d)));
    const T* px = cptr<T>(x);
    T* py = mptr<T>(y);
    if (d <= kRegMaxD) {
      switch (d) {
        case 1:
        case 2:
        case 4:
        case 8:
        case 16:
        case 32:
          launch_reg<1>(px, py, rows, d, norm);
          break;
        case 64:
          launch_reg<2>(px, py, rows, d, norm);
          break;
        case 128:
          launch_reg<4>(px, py, rows, d, norm);
          break;
        case 256:
          launch_reg<8>(px, py, rows, d, norm);
          break;
        case 512:
          launch_reg<16>(px, py, rows, d, norm);
          break;
        default:
          launch_reg<32>(px, py, rows, d, norm);
          break;
      }
    } else {
      const size_t smem = size_t(d) * sizeof(A);
      HLM_CHECK(smem <= size_t(smem_optin()),
                "hadamard: a row of {} elements does not fit the shared memory of one block", d);
      if (smem > 48 * 1024)
        set_smem(reinterpret_cast<const void*>(&hadamard_smem_kernel<T>), smem, "hadamard");
      hadamard_smem_kernel<T><<<unsigned(rows), kThreads, smem>>>(px, py, d, norm);
    }
    check_launch("hadamard");
  });
}

}  // namespace hlm::ops::cuda
