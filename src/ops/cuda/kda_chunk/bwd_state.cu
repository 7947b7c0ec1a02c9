// KDA chunked backward on CUDA, B3: the reverse state pass (params.cuh; docs/kda.md, "CUDA chunked
// backward"), C = 64; the stages and their notation are listed in bwd_launch.cu. Per (sequence,
// value head, V tile), chunks last to first, dS starting at d_final_state (or 0):
//   dh[c] = dS;  dV_new = A_qk^T dO + kg dS;  dS <- Diag(exp G_L) dS + qg^T dO - W^T dV_new
// and dinitial_state = the final dS.
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

// Row strides of the reverse state pass's shared arrays, chosen for conflict-free fragment loads
// (mma_tf32.cuh): kg is read as A = Mat (ld = 4 mod 32), qg and W as A = MatT, A_qk as A = MatT
// and the V tiles as B = Mat (ld = 8 mod 32).
// The BV-wide tiles (dS, dO, dV_new) have row stride BV + 8.
constexpr int kAqP = kC + 8;  // A_qk [C][kAqP]

__host__ __device__ constexpr int state_bwd_smem_floats(int K, int BV) {
  const int kTP8 = BV + 8;
  return K * kTP8            // dS tile
         + kC * (K + 4)      // kg
         + 2 * kC * (K + 8)  // qg, W
         + kC * kAqP         // A_qk
         + K                 // exp(G_L)
         + 2 * kC * kTP8;    // dO tile, dV_new tile
}

// Per (sequence, value head, BV-wide V tile), chunks last to first. Eight warps; warp w computes
// the dV_new rows 16 (w / 2) .. + 15, columns (w % 2) BV / 2 .. + BV / 2 - 1 and the dS rows
// 16 w' .. + 15 (w' = w, w + 8, ..; all BV columns) on tensor cores. Operands arrive by cp.async in
// two groups per chunk, {A_qk, kg} and {qg, W, exp(G_L)}, each issued for the next (earlier) chunk
// as soon as the current one has consumed its buffers.
template <int K, int BV, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads) kda_state_bwd_kernel(const BwdParams<Tin> p) {
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KA = K + 4, KB = K + 8, kTP8 = BV + 8, WN = BV / 8;
  extern __shared__ float4 smem4[];
  float* sDS = reinterpret_cast<float*>(smem4);  // [K][kTP8]
  float* sKg = sDS + K * kTP8;                   // [C][KA]
  float* sQg = sKg + kC * KA;                    // [C][KB]
  float* sW = sQg + kC * KB;                     // [C][KB]
  float* sA = sW + kC * KB;                      // [C][kAqP]
  float* sGl = sA + kC * kAqP;                   // [K]
  float* sDO = sGl + K;                          // [C][kTP8]
  float* sDV = sDO + kC * kTP8;                  // [C][kTP8]

  const int t = threadIdx.x, warp = t >> 5;
  const int nvt = p.V / BV;
  const int vt = int(blockIdx.x % unsigned(nvt));
  const int nh = int(blockIdx.x / unsigned(nvt));
  const int h = nh % p.HV, n = nh / p.HV;
  const int v0 = vt * BV;
  const int64_t sbase = (int64_t(n) * p.HV + h) * K * p.V + v0;
  auto task_of = [&](int ci) { return int64_t(ci) * p.HV + h; };
  auto fetch_a = [&](int ci) {  // {A_qk, kg} of chunk ci
    const int64_t tk = task_of(ci);
    cp_rows(sA, kAqP, p.aqk + tk * kC * kC, kC, kC, kC);
    cp_rows(sKg, KA, p.kg + tk * kC * K, K, kC, K);
  };
  auto fetch_b = [&](int ci) {  // {qg, W, exp(G_L)} of chunk ci
    const int64_t tk = task_of(ci);
    cp_rows(sQg, KB, p.qg + tk * kC * K, K, kC, K);
    cp_rows(sW, KB, p.w + tk * kC * K, K, kC, K);
    cp_rows(sGl, K, p.gl + tk * K, K, 1, K);
  };

  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(sDS + d * kTP8 + c,
        p.dht ? ld4(p.dht + sbase + int64_t(d) * p.V + c) : make_float4(0.f, 0.f, 0.f, 0.f));
  }
  const int c_first = p.first_chunk[n], c_last = p.first_chunk[n + 1] - 1;
  if (c_last >= c_first) {
    fetch_a(c_last);
    cp_async_commit();
    fetch_b(c_last);
    cp_async_commit();
  }
  // dO of a chunk, loaded into registers one chunk ahead (its latency then hides behind the
  // current chunk's products).
  constexpr int ND = kC * BV / kThreads;
  static_assert(kC * BV % kThreads == 0, "whole dO elements per thread");
  float rdo[ND];
  auto load_do = [&](int ci) {
    const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int i = t + kThreads * j, r = i / BV, c = i % BV;
      rdo[j] = r < L ? to_f(p.dO[((int64_t(bos) + r) * p.HV + h) * p.V + v0 + c]) : 0.f;
    }
  };
  if (c_last >= c_first) load_do(c_last);
  for (int ci = c_last; ci >= c_first; --ci) {
    const int L = p.chunk_len[ci];
    const int64_t tk = task_of(ci);
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int i = t + kThreads * j;
      sDO[(i / BV) * kTP8 + i % BV] = rdo[j];
    }
    if (ci > c_first) load_do(ci - 1);
    {  // dh[c] = dS (the gradient w.r.t. the state at the end of chunk c)
      float* dst = p.dh + tk * K * p.V + v0;
      for (int i = t; i < K * BV / 4; i += kThreads) {
        const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
        st4(dst + int64_t(d) * p.V + c, ld4(sDS + d * kTP8 + c));
      }
    }
    cp_async_wait<1>();  // {A_qk, kg} of this chunk landed
    __syncthreads();

    {  // dV_new = A_qk^T dO + kg dS (A_qk[s][r] = 0 for s < r: the A_qk^T sum starts at row m0)
      const int m0 = 16 * (warp >> 1), n0 = (BV / 2) * (warp & 1);
      float acc[1][WN / 2][4];
      zero(acc);
      warp_mma<P>(acc, MatT{sA, kAqP}, Exact<Mat>{{sDO, kTP8}}, m0, n0, m0, kC);
      warp_mma<P>(acc, Mat{sKg, KA}, Mat{sDS, kTP8}, m0, n0, 0, K);
      float* dst = p.dvnew + tk * kC * p.V + v0;
      for_each(acc, m0, n0, [&](int r, int c, float x) {
        sDV[r * kTP8 + c] = x;
        dst[int64_t(r) * p.V + c] = x;
      });
    }
    __syncthreads();  // dV_new complete; sA, sKg free
    if (ci > c_first) fetch_a(ci - 1);
    cp_async_commit();   // (possibly empty: keeps the group count uniform)
    cp_async_wait<1>();  // {qg, W, exp(G_L)} of this chunk landed
    __syncthreads();

    // dS <- Diag(exp G_L) dS + qg^T dO - W^T dV_new (own elements only: in place). Rows >= L of
    // qg, W, dO and dV_new are zero; the sums stop at the first multiple of 8 >= L.
    {
      const int kend = (L + 7) & ~7;
      for (int m0 = 16 * warp; m0 < K; m0 += 16 * (kThreads / 32)) {
        float acc[1][WN][4], neg[1][WN][4];
        zero(neg);
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int d = acc_row(m0, 0, e), c = acc_col(0, j, e);
            acc[0][j][e] = sGl[d] * sDS[d * kTP8 + c];
          }
        warp_mma<P>(acc, MatT{sQg, KB}, Exact<Mat>{{sDO, kTP8}}, m0, 0, 0, kend);
        warp_mma<P>(neg, MatT{sW, KB}, Mat{sDV, kTP8}, m0, 0, 0, kend);
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sDS[acc_row(m0, 0, e) * kTP8 + acc_col(0, j, e)] = acc[0][j][e] - neg[0][j][e];
      }
    }
    __syncthreads();  // dS updated; sQg, sW, sGl, sDO, sDV free
    if (ci > c_first) fetch_b(ci - 1);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(p.o_dh0 + sbase + int64_t(d) * p.V + c, ld4(sDS + d * kTP8 + c));
  }
}

}  // namespace

template <class Tin>
void launch_state_bwd(const Plan& pl, const BwdParams<Tin>& bp, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    with_state_tile(pl, [&](auto bv) {
      constexpr int K = decltype(kc)::value, BV = decltype(bv)::value;
      const size_t smem = size_t(state_bwd_smem_floats(K, BV)) * sizeof(float);
      with_prec<kStageStateBwd, Tin>(tf32, [&](auto tf32c) {
        constexpr bool F = decltype(tf32c)::value;
        set_smem(kOp, reinterpret_cast<const void*>(&kda_state_bwd_kernel<K, BV, Tin, F>), smem,
                 "state bwd");
        kda_state_bwd_kernel<K, BV, Tin, F>
            <<<unsigned(pl.N * pl.HV * (pl.V / BV)), kThreads, smem>>>(bp);
      });
      check_launch(kOp, "state bwd kernel");
    });
  });
}

template void launch_state_bwd<float>(const Plan&, const BwdParams<float>&, unsigned);
template void launch_state_bwd<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&,
                                              unsigned);

}  // namespace hlm::ops::cuda::kda
