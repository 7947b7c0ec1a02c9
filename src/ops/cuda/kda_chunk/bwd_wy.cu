// KDA chunked backward on CUDA, B4b: the WY backward (params.cuh; docs/kda.md, "CUDA chunked
// backward"), C = 64; the stages and their notation are listed in bwd_launch.cu. Per (chunk, head,
// side: keys | values): dKB = M^-T dW, dVB = M^-T dV_new, dA_kk = -stril(dKB W^T + dVB U^T), dv =
// beta dVB, dbeta = v.dVB + (exp(G) k).dKB, dk += beta exp(G) dKB, dG += beta exp(G) k dKB (dA_kk
// and dbeta as per-side partials).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/cuda/mma_tf32.cuh"

namespace hlm::ops::cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_backward_cuda";

constexpr int kMP = kC + 8;  // row stride of M^-1 in the WY backward (read as A = MatT)

// One side per block: M^-1 [C][MP], then X and XB [C][N + 4] with N = max(K, V).
__host__ __device__ constexpr int wy_smem_floats(int K, int V) {
  return kC * kMP + 2 * kC * ((K > V ? K : V) + 4);
}

// Block (chunk, value head, side z). The two sides are independent until dA_kk and dbeta, which
// leave as per-side partials (the intra backward and the GVA kernel add them):
//   z = 0 (keys):   dKB = M^-T dW;      X_K = dKB W^T;   dk += beta exp(G) dKB;
//                   dG += beta exp(G) k dKB;  dbeta_K = (exp(G) k) . dKB
//   z = 1 (values): dVB = M^-T dV_new;  X_V = dVB U^T;   dv = beta dVB;  dbeta_V = v . dVB
// and dA_kk = -stril(X_K + X_V).
template <int K, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2) kda_bwd_wy_kernel(const BwdParams<Tin> p) {
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  extern __shared__ float4 smem4[];
  const int V = p.V;
  const int z = blockIdx.z;
  const int N = z == 0 ? K : V, NP = N + 4;     // this side's width and row stride
  float* sM = reinterpret_cast<float*>(smem4);  // [C][MP]  M^-1
  float* sA = sM + kC * kMP;                    // [C][NP]  dW | dV_new, then W | U
  float* sXB = sA + kC * NP;                    // [C][NP]  dKB | dVB

  const int t = threadIdx.x;
  const int ci = blockIdx.x, h = blockIdx.y;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int64_t tk = int64_t(ci) * p.HV + h;

  cp_rows(sM, kMP, p.minv + tk * kC * kC, kC, kC, kC);
  cp_rows(sA, NP, (z == 0 ? p.dw : p.dvnew) + tk * kC * N, N, kC, N);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  // dKB = M^-T dW | dVB = M^-T dV_new (M^-1[r][s] = 0 for r < s)
  block_mma<P, 1, 4>(kC, N, kC, MatT{sM, kMP}, Mat{sA, NP},
                     [&](int s, int d, float acc) { sXB[s * NP + d] = acc; });
  __syncthreads();
  cp_rows(sA, NP, (z == 0 ? p.w : p.u) + tk * kC * N, N, kC, N);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  {  // X_K = dKB W^T | X_V = dVB U^T (the intra backward forms dA_kk = -stril(X_K + X_V))
    float* xo = (z == 0 ? p.dakk : p.dakv) + tk * kC * kC;
    block_mma<P, 1, 4>(kC, kC, N, Mat{sXB, NP}, MatT{sA, NP},
                       [&](int r, int s, float acc) { xo[r * kC + s] = acc; });
  }
  // One warp per row; the loads of a row come before its stores (which could otherwise serialise
  // them).
  const int warp = t >> 5, lane = t & 31;
  if (z == 0) {
    static_assert(K % 32 == 0, "whole lanes per row");
    constexpr int NK = K / 32;
    const float* G = p.G + tk * kC * K;
    const float* kn = p.kn + tk * kC * K;
    float* dk = p.dk + tk * kC * K;
    float* dG = p.dG + tk * kC * K;
    for (int s = warp; s < L; s += kThreads / 32) {
      const float bs = p.beta[tk * kC + s];
      float ge[NK], gk[NK], gdk[NK], gdG[NK];
#pragma unroll
      for (int dd = 0; dd < NK; ++dd) {
        const int d = lane + 32 * dd;
        ge[dd] = G[s * K + d];
        gk[dd] = kn[s * K + d];
        gdk[dd] = dk[s * K + d];
        gdG[dd] = dG[s * K + d];
      }
      float db = 0.f;
#pragma unroll
      for (int dd = 0; dd < NK; ++dd) {
        const int d = lane + 32 * dd;
        const float e = exp_in<Tin>(ge[dd]), x = sXB[s * NP + d];
        const float gk2 = e * gk[dd] * x;
        db += gk2;
        dk[s * K + d] = gdk[dd] + bs * e * x;
        dG[s * K + d] = gdG[dd] + bs * gk2;
      }
      for (int off = 16; off > 0; off >>= 1) db += __shfl_xor_sync(0xffffffffu, db, off);
      if (lane == 0) p.dbw[(tk * 2 + 0) * kC + s] = db;
    }
  } else {
    for (int s = warp; s < L; s += kThreads / 32) {
      const int64_t tok = int64_t(bos) + s;
      const float bs = p.beta[tk * kC + s];
      float gv[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {  // V <= 128
        const int j = lane + 32 * jj;
        gv[jj] = j < V ? to_f(p.v[(tok * p.HV + h) * V + j]) : 0.f;
      }
      float db = 0.f;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = lane + 32 * jj;
        if (j < V) {
          const float x = sXB[s * NP + j];
          p.o_dv[(tok * p.HV + h) * V + j] = bs * x;
          db = fmaf(gv[jj], x, db);
        }
      }
      for (int off = 16; off > 0; off >>= 1) db += __shfl_xor_sync(0xffffffffu, db, off);
      if (lane == 0) p.dbw[(tk * 2 + 1) * kC + s] = db;
    }
  }
}

}  // namespace

template <class Tin>
void launch_wy_bwd(const Plan& pl, const BwdParams<Tin>& bp, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    const size_t smem = size_t(wy_smem_floats(K, int(pl.V))) * sizeof(float);
    with_prec<kStageWy, Tin>(tf32, [&](auto tf32c) {
      constexpr bool F = decltype(tf32c)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_wy_kernel<K, Tin, F>), smem, "wy bwd");
      kda_bwd_wy_kernel<K, Tin, F>
          <<<dim3(unsigned(pl.NC), unsigned(pl.HV), 2), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "wy bwd kernel");
  });
}

template void launch_wy_bwd<float>(const Plan&, const BwdParams<float>&, unsigned);
template void launch_wy_bwd<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&, unsigned);

}  // namespace hlm::ops::cuda::kda
