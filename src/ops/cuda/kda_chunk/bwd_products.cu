// KDA chunked backward on CUDA, B4a: the contractions over V (params.cuh; docs/kda.md, "CUDA
// chunked backward"), C = 64; the stages and their notation are listed in bwd_launch.cu. Per
// (chunk, head, slice of 64 channels):
//   dA_qk = tril_incl(dO V_new^T);  dq = scale exp(G) (dO S^T);  dk = exp(G_L - G) (V_new dS'^T)
//   dW = -dV_new S^T;  dG = q dq - k dk;  dG_{L-1} += sum_r k dk + exp(G_L) rowsum(S . dS')
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

constexpr int kSpKT = 16;  // channels per S / dS' tile of the contractions

// dO as read from the input (raw Tin: exact), with rows padded to V + 8 elements.
template <class Tin>
struct MatIn {
  const Tin* p;
  int ld;
  __device__ __forceinline__ float operator()(int i, int j) const { return to_f(p[i * ld + j]); }
};

// Shared floats: dO [C][V + 8] (Tin), V_new and dV_new [C][V + 4], one S and one dS' tile
// [KT][V + 4], k dk and dq [C][KT + 1], rowsum [KT]. bf16, V = 128: ~108 KB, two blocks per SM.
template <class Tin>
__host__ __device__ constexpr int sp_do_floats(int V) {
  return (kC * (V + 8) * int(sizeof(Tin)) + 15) / 16 * 4;
}
template <class Tin>
__host__ __device__ constexpr int sp_smem_floats(int V) {
  return sp_do_floats<Tin>(V) + 2 * kC * (V + 4) + 2 * kSpKT * (V + 4) + 2 * kC * (kSpKT + 1) +
         kSpKT;
}

// Block (chunk, value head, channel slice z of slice_k(K) channels): dA_qk rows C / NS z ..,
// and dq, dk, dW, dG of the slice's channels, 16 channels (one S / dS' tile) at a time.
template <int K, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2)
    kda_bwd_state_products_kernel(const BwdParams<Tin> p) {
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KH = slice_k(K), NS = slices(K), KT = kSpKT;
  static_assert(2 * (kC / 16) == kThreads / 32 && KT == 16, "two sides of 16 x 16 warp tiles");
  extern __shared__ float4 smem4[];
  const int V = p.V, VP = V + 4, DP = V + 8;
  Tin* sDO = reinterpret_cast<Tin*>(smem4);                             // [C][DP]
  float* sVn = reinterpret_cast<float*>(smem4) + sp_do_floats<Tin>(V);  // [C][VP]
  float* sDV = sVn + kC * VP;                                           // [C][VP]
  float* sS = sDV + kC * VP;                                            // [KT][VP]
  float* sDS = sS + KT * VP;                                            // [KT][VP]
  float* sKD = sDS + KT * VP;                                           // [C][KT + 1]
  float* sDQ = sKD + kC * (KT + 1);                                     // [C][KT + 1]
  float* sRow = sDQ + kC * (KT + 1);                                    // [KT]

  const int t = threadIdx.x, warp = t >> 5;
  const int ci = blockIdx.x, h = blockIdx.y, z = blockIdx.z, c_lo = KH * z;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int64_t tk = int64_t(ci) * p.HV + h;
  const float* G = p.G + tk * kC * K;
  const float* qn = p.qn + tk * kC * K;
  const float* kn = p.kn + tk * kC * K;
  const float* gl = p.gl + tk * K;
  float* dq = p.dq + tk * kC * K;
  float* dk = p.dk + tk * kC * K;
  float* dw = p.dw + tk * kC * K;
  float* dG = p.dG + tk * kC * K;

  constexpr int E16 = 16 / int(sizeof(Tin));  // elements per 16-byte copy
  for (int i = t; i < kC * (V / E16); i += kThreads) {
    const int r = i / (V / E16), c = E16 * (i % (V / E16));
    Tin* dst = sDO + r * DP + c;
    if (r < L)
      cp_async16(reinterpret_cast<float*>(dst),
                 reinterpret_cast<const float*>(p.dO + ((int64_t(bos) + r) * p.HV + h) * V + c));
    else
      *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  cp_rows(sVn, VP, p.vnew + tk * kC * V, V, kC, V);
  cp_rows(sDV, VP, p.dvnew + tk * kC * V, V, kC, V);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  {  // dA_qk = tril_incl(dO V_new^T), rows C / NS z .. of this block
    constexpr int RB = kC / NS;
    float* da = p.daqk + tk * kC * kC + RB * z * kC;
    block_mma<P, 1, 2>(
        RB, kC, V, Exact<MatIn<Tin>>{{sDO + RB * z * DP, DP}}, MatT{sVn, VP},
        [&](int r, int s, float acc) { da[r * kC + s] = s <= r + RB * z ? acc : 0.f; });
  }
  const float* GL = G + (L - 1) * K;
  // Two sides of four warps; warp w owns rows 16 (w % 4) .. of the tile's 16 channels:
  //   q side (w < 4): dq = scale exp(G) (dO S^T) and dW = -dV_new S^T (one S fragment for both);
  //   k side (w >= 4): dk = exp(G_L - G) (V_new dS'^T).
  // dG = q dq - k dk meets in shared memory after the tile's second barrier, one element per
  // thread and row group (rows (t / 16) + 16 j, channel t % 16). Every global operand of a tile
  // is loaded before its products (the stores would otherwise serialise the loads).
  const bool qside = warp < 4;
  const int m0 = 16 * (warp & 3), ei = t & 15, er = t >> 4;
  for (int d0 = c_lo; d0 < c_lo + KH; d0 += KT) {
    // sS, sDS were last read before the second barrier of the previous tile.
    cp_rows(sS, VP, p.h + tk * K * V + int64_t(d0) * V, V, KT, V);
    cp_rows(sDS, VP, p.dh + tk * K * V + int64_t(d0) * V, V, KT, V);
    cp_async_commit();
    float gG[2][4], gL[2][4], gk[2][4], gq[4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = acc_row(m0, 0, e), d = d0 + acc_col(0, j, e);
        gG[j][e] = G[r * K + d];
        if (!qside) {
          gL[j][e] = GL[d];
          gk[j][e] = kn[r * K + d];
        }
      }
#pragma unroll
    for (int j = 0; j < 4; ++j) gq[j] = qn[(er + 16 * j) * K + d0 + ei];
    cp_async_wait<0>();
    __syncthreads();  // the tiles landed; sKD, sDQ, sRow of the previous tile consumed
    if (qside) {
      float a1[1][2][4], a3[1][2][4];
      zero(a1);
      zero(a3);
      warp_mma_pair<P>(a1, Exact<MatIn<Tin>>{{sDO, DP}}, a3, Mat{sDV, VP}, MatT{sS, VP}, m0, 0, 0,
                       V);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = acc_row(m0, 0, e), i = acc_col(0, j, e), d = d0 + i;
          const float dqv = p.scale * exp_in<Tin>(gG[j][e]) * a1[0][j][e];
          dq[r * K + d] = dqv;
          dw[r * K + d] = -a3[0][j][e];
          sDQ[r * (KT + 1) + i] = dqv;
        }
    } else {
      float a2[1][2][4];
      zero(a2);
      warp_mma<P>(a2, Mat{sVn, VP}, MatT{sDS, VP}, m0, 0, 0, V);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = acc_row(m0, 0, e), i = acc_col(0, j, e), d = d0 + i;
          const float dkd = exp_in<Tin>(gL[j][e] - gG[j][e]) * a2[0][j][e];
          dk[r * K + d] = dkd;
          sKD[r * (KT + 1) + i] = gk[j][e] * dkd;
        }
    }
    {  // rowsum(S . dS'): 16 lanes per row, lane-strided, then a butterfly over the 16 lanes
      static_assert(kThreads == 16 * KT, "16 lanes per row");
      const int i = t >> 4, part = t & 15;
      float s = 0.f;
      for (int j = part; j < V; j += 16) s = fmaf(sS[i * VP + j], sDS[i * VP + j], s);
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      if (part == 0) sRow[i] = s;
    }
    __syncthreads();
    // dG = q dq - k dk; row L - 1 also gets sum_r k dk + exp(G_L) rowsum(S . dS') (from t < KT).
    const int d = d0 + ei;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = er + 16 * j;
      if (r != L - 1) dG[r * K + d] = gq[j] * sDQ[r * (KT + 1) + ei] - sKD[r * (KT + 1) + ei];
    }
    if (t < KT) {
      const int r = L - 1;
      const float dgl = qn[r * K + d] * sDQ[r * (KT + 1) + t] - sKD[r * (KT + 1) + t];
      float s = 0.f;
      for (int r2 = 0; r2 < kC; ++r2) s += sKD[r2 * (KT + 1) + t];  // rows >= L are zero
      dG[r * K + d] = dgl + (s + gl[d] * sRow[t]);
    }
  }
}

}  // namespace

template <class Tin>
void launch_bwd_products(const Plan& pl, const BwdParams<Tin>& bp, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    const size_t smem = size_t(sp_smem_floats<Tin>(int(pl.V))) * sizeof(float);
    with_prec<kStageProducts, Tin>(tf32, [&](auto tf32c) {
      constexpr bool F = decltype(tf32c)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_state_products_kernel<K, Tin, F>), smem,
               "state products");
      kda_bwd_state_products_kernel<K, Tin, F>
          <<<dim3(unsigned(pl.NC), unsigned(pl.HV), unsigned(slices(K))), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "state products kernel");
  });
}

template void launch_bwd_products<float>(const Plan&, const BwdParams<float>&, unsigned);
template void launch_bwd_products<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&,
                                                 unsigned);

}  // namespace hlm::ops::cuda::kda
