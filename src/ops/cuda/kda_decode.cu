// KDA decode step on CUDA. Grid: (ceil(V / 32), HV, N); block: 4 warps. Lane l of every warp
// owns state column j = 32 * blockIdx.x + l; warp w owns the K / 4 rows [w K/4, (w+1) K/4) of it,
// kept in registers, so the state is read once and written once, coalesced along V. The two sums
// over K (the prediction S^T k and the output S^T q) are per-warp partial sums combined through
// shared memory in a fixed order: the result is bit-identical run to run.
// q, k and exp(g) of the head are staged in shared memory first.
#include <cuda_bf16.h>

#include "ops/cuda/kda_decode.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kWarps = 4;

template <class T>
__device__ float load_f(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    return __bfloat162float(p[i]);
  }
}

// Sum of a value over the block's 4 warps (after a warp reduction), the same in every thread.
__device__ float block_sum4(float x, float (*red)[kWarps], int slot) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0) red[slot][threadIdx.x >> 5] = x;
  __syncthreads();
  return ((red[slot][0] + red[slot][1]) + red[slot][2]) + red[slot][3];
}

template <int K, class T>
__global__ void __launch_bounds__(32 * kWarps)
    kda_decode_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta,
                      float* __restrict__ state, const int64_t* __restrict__ slots,
                      float* __restrict__ o, int H, int HV, int V, int64_t q_row, int64_t k_row,
                      int64_t v_row, float scale, bool l2norm) {
  constexpr int KP = K / kWarps;  // rows per warp
  const int n = blockIdx.z, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = blockIdx.x * 32 + lane;
  const int64_t slot = slots[n];
  __shared__ float sq[K], sk[K], sa[K], red[2][kWarps], part[2][kWarps][32];
  const int hk = h / (HV / H);
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    sq[i] = load_f(q, n * q_row + int64_t(hk) * K + i);
    sk[i] = load_f(k, n * k_row + int64_t(hk) * K + i);
    sa[i] = expf(g[(int64_t(n) * HV + h) * K + i]);
  }
  __syncthreads();
  float qs = scale, ks = 1.0f;
  if (l2norm) {
    float a = 0, b = 0;
    for (int i = threadIdx.x; i < K; i += blockDim.x) a += sq[i] * sq[i], b += sk[i] * sk[i];
    a = block_sum4(a, red, 0);
    b = block_sum4(b, red, 1);
    qs = scale / sqrtf(a + 1e-6f);
    ks = 1.0f / sqrtf(b + 1e-6f);
  }
  const bool active = slot >= 0 && j < V;
  float* S = state + (slot * HV + h) * int64_t(K) * V + int64_t(warp) * KP * V + j;
  float col[KP];
  float pred = 0;
  if (active) {
#pragma unroll
    for (int r = 0; r < KP; ++r) col[r] = S[int64_t(r) * V];
#pragma unroll
    for (int r = 0; r < KP; ++r) {
      col[r] *= sa[warp * KP + r];
      pred = fmaf(col[r], sk[warp * KP + r] * ks, pred);
    }
  }
  part[0][warp][lane] = pred;
  __syncthreads();
  pred = ((part[0][0][lane] + part[0][1][lane]) + part[0][2][lane]) + part[0][3][lane];
  float out = 0;
  if (active) {
    const float u = beta[int64_t(n) * HV + h] * (load_f(v, n * v_row + int64_t(h) * V + j) - pred);
#pragma unroll
    for (int r = 0; r < KP; ++r) {
      col[r] = fmaf(sk[warp * KP + r] * ks, u, col[r]);
      out = fmaf(col[r], sq[warp * KP + r] * qs, out);
    }
#pragma unroll
    for (int r = 0; r < KP; ++r) S[int64_t(r) * V] = col[r];
  }
  part[1][warp][lane] = out;
  __syncthreads();
  if (warp == 0 && j < V)
    o[(int64_t(n) * HV + h) * V + j] =
        slot < 0 ? 0.0f
                 : ((part[1][0][lane] + part[1][1][lane]) + part[1][2][lane]) + part[1][3][lane];
}

template <class T>
void launch(const KdaDecodeArgs& a, const int64_t* slots, float scale, Tensor& o) {
  const int N = int(a.q.size(0)), H = int(a.q.size(1)), K = int(a.q.size(2));
  const int HV = int(a.v.size(1)), V = int(a.v.size(2));
  const dim3 grid(unsigned((V + 31) / 32), unsigned(HV), unsigned(N)), block(32 * kWarps);
  auto go = [&](auto kc) {
    constexpr int KK = decltype(kc)::value;
    kda_decode_kernel<KK, T>
        <<<grid, block>>>(static_cast<const T*>(a.q.raw()), static_cast<const T*>(a.k.raw()),
                          static_cast<const T*>(a.v.raw()), a.g.data<float>(), a.beta.data<float>(),
                          a.state.data<float>(), slots, o.data<float>(), H, HV, V, a.q.stride(0),
                          a.k.stride(0), a.v.stride(0), scale, a.use_qk_l2norm);
  };
  switch (K) {
    case 32:
      go(std::integral_constant<int, 32>{});
      break;
    case 64:
      go(std::integral_constant<int, 64>{});
      break;
    case 128:
      go(std::integral_constant<int, 128>{});
      break;
    case 256:
      go(std::integral_constant<int, 256>{});
      break;
    default:
      HLM_FAIL("kda_decode_step on CUDA: K must be 32, 64, 128 or 256, got {}", K);
  }
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "kda_decode kernel launch: {}", cudaGetErrorString(err));
}

}  // namespace

void kda_decode_step(const KdaDecodeArgs& a, const std::vector<int64_t>& slots, double scale,
                     Tensor& o) {
  Tensor s = to_device(slots);
  if (a.q.dtype() == DType::bf16) {
    launch<__nv_bfloat16>(a, s.data<int64_t>(), float(scale), o);
  } else {
    launch<float>(a, s.data<int64_t>(), float(scale), o);
  }
}

}  // namespace hlm::ops::cuda
