// KDA decode step on CUDA. Grid: (ceil(V / 128), HV, N); block: 128 threads, one state column
// (V index) each. q, k, g of the head are staged in shared memory; the thread keeps its K-long
// column in registers (K <= 256, a multiple of 32 chosen at compile time), so the state is read
// once and written once, coalesced along V. Each thread's sums run over K in a fixed order: the
// result is bit-identical run to run.
#include <cuda_bf16.h>

#include "ops/kda_decode.h"

namespace hlm::ops::cuda {
namespace {

template <class T>
__device__ float load_f(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    return __bfloat162float(p[i]);
  }
}

template <int K, class T>
__global__ void __launch_bounds__(128)
    kda_decode_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta,
                      float* __restrict__ state, const int64_t* __restrict__ slots,
                      float* __restrict__ o, int H, int HV, int V, float scale, bool l2norm) {
  const int n = blockIdx.z, h = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t slot = slots[n];
  __shared__ float sq[K], sk[K], sa[K], red[2][4];
  const int hk = h / (HV / H);
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    sq[i] = load_f(q, (int64_t(n) * H + hk) * K + i);
    sk[i] = load_f(k, (int64_t(n) * H + hk) * K + i);
    sa[i] = expf(g[(int64_t(n) * HV + h) * K + i]);
  }
  __syncthreads();
  float qs = scale, ks = 1.0f;
  if (l2norm) {
    // Sum of squares in a fixed order: each warp sums a strided slice, then warp 0 combines.
    float a = 0, b = 0;
    for (int i = threadIdx.x; i < K; i += blockDim.x) a += sq[i] * sq[i], b += sk[i] * sk[i];
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, off);
      b += __shfl_xor_sync(0xffffffffu, b, off);
    }
    if ((threadIdx.x & 31) == 0) red[0][threadIdx.x >> 5] = a, red[1][threadIdx.x >> 5] = b;
    __syncthreads();
    a = red[0][0] + red[0][1] + red[0][2] + red[0][3];
    b = red[1][0] + red[1][1] + red[1][2] + red[1][3];
    qs = scale / sqrtf(a + 1e-6f);
    ks = 1.0f / sqrtf(b + 1e-6f);
  }
  if (slot < 0 || j >= V) {
    if (j < V) o[(int64_t(n) * HV + h) * V + j] = 0.0f;
    return;
  }
  float* S = state + (slot * HV + h) * int64_t(K) * V + j;
  float col[K];
  float pred = 0;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    col[i] = S[int64_t(i) * V] * sa[i];
    pred = fmaf(col[i], sk[i] * ks, pred);
  }
  const float u = beta[int64_t(n) * HV + h] * (load_f(v, (int64_t(n) * HV + h) * V + j) - pred);
  float out = 0;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    col[i] = fmaf(sk[i] * ks, u, col[i]);
    S[int64_t(i) * V] = col[i];
    out = fmaf(col[i], sq[i] * qs, out);
  }
  o[(int64_t(n) * HV + h) * V + j] = out;
}

template <class T>
void launch(const KdaDecodeArgs& a, const int64_t* slots, float scale, Tensor& o) {
  const int N = int(a.q.size(0)), H = int(a.q.size(1)), K = int(a.q.size(2));
  const int HV = int(a.v.size(1)), V = int(a.v.size(2));
  const dim3 grid(unsigned((V + 127) / 128), unsigned(HV), unsigned(N)), block(128);
  auto go = [&](auto kc) {
    constexpr int KK = decltype(kc)::value;
    kda_decode_kernel<KK, T><<<grid, block>>>(
        static_cast<const T*>(a.q.raw()), static_cast<const T*>(a.k.raw()),
        static_cast<const T*>(a.v.raw()), a.g.data<float>(), a.beta.data<float>(),
        a.state.data<float>(), slots, o.data<float>(), H, HV, V, scale, a.use_qk_l2norm);
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
  Tensor s = Tensor::from_vector<int64_t>({int64_t(slots.size())}, slots).to(Device::cuda);
  if (a.q.dtype() == DType::bf16) {
    launch<__nv_bfloat16>(a, s.data<int64_t>(), float(scale), o);
  } else {
    launch<float>(a, s.data<int64_t>(), float(scale), o);
  }
  device_synchronize();
}

}  // namespace hlm::ops::cuda
