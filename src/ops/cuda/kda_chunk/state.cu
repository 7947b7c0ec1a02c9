// KDA chunked forward on CUDA, the state pass (params.cuh; docs/kda.md, "CUDA chunked forward"),
// C = 64: with the intermediates of the intra stage (intra.cu), sequentially over the chunks of a
// sequence with the state S [K, V] at chunk start,
//   V_new  = U - W S;   O = qg S + A_qk V_new;   S <- Diag(gl) S + kg^T V_new.
//   kda_state_kernel<K, BV, Tin>: grid (N * HV * V/BV), 256 threads, one block per (sequence,
//     value head, BV-wide V tile; BV = 32 or 64, heuristics.h), looping over the sequence's
//     chunks. The state tile S [K, BV] lives in shared memory; the next chunk's operands are
//     fetched by cp.async while the current one is computed (two commit groups per chunk:
//     {W, qg, U} for phase A, {kg, A_qk, gl} for B).
// The backward's recompute (launch.cu: recompute) runs it without the output o: it then stores
// the chunk-start states h and V_new instead.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/cuda/mma_tf32.cuh"

namespace hlm::ops::cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_forward_cuda";

// Shared-memory floats of the state kernel (all offsets multiples of 4: float4 / cp.async). Row
// strides for conflict-free tensor-core fragment loads (mma_tf32.cuh): W, qg and A_qk are read
// as A = Mat (ld = 4 mod 32), kg as A = MatT and the 32-wide tiles as B = Mat (ld = 8 mod 32).
// The BV-wide tiles have row stride BV + 8.
constexpr int kAqP = kC + 4;  // A_qk [C][kAqP]
__host__ __device__ constexpr int state_smem_floats(int K, int BV) {
  return 2 * kC * (K + 4)     // W, qg
         + kC * (K + 8)       // kg
         + 3 * kC * (BV + 8)  // U tile, V_new, qg S (then O)
         + kC * kAqP          // A_qk
         + K                  // gl
         + K * (BV + 8);      // S tile
}

// ------------------------------------------------------------------ state-pass kernel

// Issue the cp.async copies of phase A's operands of one chunk: W, qg [C][K] (qg null: not
// fetched, no output) and the U tile.
template <int K, int BV>
__device__ __forceinline__ void fetch_a(const float* w, const float* qg, const float* u, int V,
                                        float* sW, float* sQg, float* sU) {
  constexpr int K4 = K / 4;
  for (int i = threadIdx.x; i < kC * K4; i += kThreads) {
    const int r = i / K4, c = 4 * (i % K4);
    cp_async16(sW + r * (K + 4) + c, w + 4 * i);
    if (qg) cp_async16(sQg + r * (K + 4) + c, qg + 4 * i);
  }
  for (int i = threadIdx.x; i < kC * BV / 4; i += kThreads) {
    const int r = i / (BV / 4), c = 4 * (i % (BV / 4));
    cp_async16(sU + r * (BV + 8) + c, u + int64_t(r) * V + c);
  }
}

// ... and phase B's: kg [C][K], A_qk [C][C] (null: not fetched), gl [K].
template <int K>
__device__ __forceinline__ void fetch_b(const float* kg, const float* aqk, const float* gl,
                                        float* sKg, float* sAqk, float* sGl) {
  constexpr int K4 = K / 4, C4 = kC / 4;
  for (int i = threadIdx.x; i < kC * K4; i += kThreads)
    cp_async16(sKg + (i / K4) * (K + 8) + 4 * (i % K4), kg + 4 * i);
  if (aqk)
    for (int i = threadIdx.x; i < kC * C4; i += kThreads)
      cp_async16(sAqk + (i / C4) * kAqP + 4 * (i % C4), aqk + 4 * i);
  if (threadIdx.x < K4) cp_async16(sGl + 4 * threadIdx.x, gl + 4 * threadIdx.x);
}

__device__ __forceinline__ void store1(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// Per (sequence, value head, BV-wide V tile), chunks in order; eight warps, all products on
// tensor cores (mma_tf32.cuh: TF32 or 3xTF32 for bf16 inputs, FP32 FMA for f32).
//   phase A: warps 0-3 V_new = U - W S, warps 4-7 qg S, rows 16 (w % 4) .. + 15, all BV columns
//            (no output: every warp V_new, rows 16 (w % 4) .., half the columns);
//   phase B: O = qg S + A_qk V_new (rows 16 (w % 4) .. + 15, half the columns; A_qk lower
//            triangular: the sum stops at the tile's last row), then every warp S <- Diag(gl) S
//            + kg^T V_new for the state rows 16 w' .. + 15 (w' = w, w + 8, ..; own elements: in
//            place).
template <int K, int BV, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads) kda_state_kernel(const StateParams<Tin> p) {
  static_assert(K % 32 == 0 && K <= 128, "K must be 32, 64 or 128");
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KA = K + 4, KB = K + 8, kT8 = BV + 8, WN = BV / 8;
  extern __shared__ float4 smem4[];
  float* sW = reinterpret_cast<float*>(smem4);  // [C][KA]   W
  float* sQg = sW + kC * KA;                    // [C][KA]   qg
  float* sU = sQg + kC * KA;                    // [C][kT8]  U tile
  float* sKg = sU + kC * kT8;                   // [C][KB]   kg
  float* sAqk = sKg + kC * KB;                  // [C][kAqP] A_qk
  float* sGl = sAqk + kC * kAqP;                // [K]       exp(G_{L-1})
  float* sVn = sGl + K;                         // [C][kT8]  V_new
  float* sO = sVn + kC * kT8;                   // [C][kT8]  qg S
  float* sS = sO + kC * kT8;                    // [K][kT8]  state tile

  const int t = threadIdx.x, warp = t >> 5;
  const int nvt = p.V / BV;
  const int vt = int(blockIdx.x % unsigned(nvt));
  const int nh = int(blockIdx.x / unsigned(nvt));
  const int h = nh % p.HV, n = nh / p.HV;
  const int v0 = vt * BV;
  const int64_t sbase = (int64_t(n) * p.HV + h) * K * p.V + v0;  // S[n][h][0][v0]

  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(sS + d * kT8 + c,
        p.h0 ? ld4(p.h0 + sbase + int64_t(d) * p.V + c) : make_float4(0.f, 0.f, 0.f, 0.f));
  }

  const int c_begin = p.first_chunk[n], c_end = p.first_chunk[n + 1];
  auto task_of = [&](int ci) { return int64_t(ci) * p.HV + h; };
  if (c_begin < c_end) {
    const int64_t tk = task_of(c_begin);
    fetch_a<K, BV>(p.w + tk * kC * K, p.o ? p.qg + tk * kC * K : nullptr, p.u + tk * kC * p.V + v0,
                   p.V, sW, sQg, sU);
    cp_async_commit();
    fetch_b<K>(p.kg + tk * kC * K, p.o ? p.aqk + tk * kC * kC : nullptr, p.gl + tk * K, sKg, sAqk,
               sGl);
    cp_async_commit();
  }
  for (int ci = c_begin; ci < c_end; ++ci) {
    const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
    cp_async_wait<1>();  // this chunk's {W, qg, U} landed ({kg, A_qk, gl} may be in flight)
    __syncthreads();
    if (p.h_out) {  // backward recompute: the state at the chunk start
      float* hs = p.h_out + task_of(ci) * K * p.V + v0;
      for (int i = t; i < K * BV / 4; i += kThreads) {
        const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
        st4(hs + int64_t(d) * p.V + c, ld4(sS + d * kT8 + c));
      }
    }

    if (p.o) {  // ---- phase A: warps 0-3 V_new = U - W S, warps 4-7 qg S
      const int role = warp >> 2, m0 = 16 * (warp & 3);
      float acc[1][WN][4];
      zero(acc);
      warp_mma<P>(acc, Mat{role ? sQg : sW, KA}, Mat{sS, kT8}, m0, 0, 0, K);
      if (role == 0)
        for_each(acc, m0, 0,
                 [&](int r, int c, float x) { sVn[r * kT8 + c] = sU[r * kT8 + c] - x; });
      else
        for_each(acc, m0, 0, [&](int r, int c, float x) { sO[r * kT8 + c] = x; });
    } else {  // ---- phase A without an output: V_new over all eight warps (half a tile row each)
      const int m0 = 16 * (warp & 3), n0 = (BV / 2) * (warp >> 2);
      float acc[1][WN / 2][4];
      zero(acc);
      warp_mma<P>(acc, Mat{sW, KA}, Mat{sS, kT8}, m0, n0, 0, K);
      for_each(acc, m0, n0, [&](int r, int c, float x) { sVn[r * kT8 + c] = sU[r * kT8 + c] - x; });
    }
    __syncthreads();   // V_new, qg S complete; sW, sQg, sU free
    if (p.vnew_out) {  // backward recompute: V_new (all C rows; padded rows are zero)
      float* vs = p.vnew_out + task_of(ci) * kC * p.V + v0;
      for (int i = t; i < kC * BV / 4; i += kThreads) {
        const int r = i / (BV / 4), c = 4 * (i % (BV / 4));
        st4(vs + int64_t(r) * p.V + c, ld4(sVn + r * kT8 + c));
      }
    }
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_a<K, BV>(p.w + tk * kC * K, p.o ? p.qg + tk * kC * K : nullptr,
                     p.u + tk * kC * p.V + v0, p.V, sW, sQg, sU);
    }
    cp_async_commit();   // (possibly empty: keeps the group count uniform)
    cp_async_wait<1>();  // this chunk's {kg, A_qk, gl} landed
    __syncthreads();

    // ---- phase B
    if (p.o) {  // O = qg S + A_qk V_new: rows 16 (w % 4) .., half the columns per warp
      const int m0 = 16 * (warp & 3), n0 = (BV / 2) * (warp >> 2);
      float acc[1][WN / 2][4];
#pragma unroll
      for (int j = 0; j < WN / 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][j][e] = sO[acc_row(m0, 0, e) * kT8 + acc_col(n0, j, e)];
      warp_mma<P>(acc, Mat{sAqk, kAqP}, Mat{sVn, kT8}, m0, n0, 0, m0 + 16);
      for_each(acc, m0, n0, [&](int r, int c, float x) {
        if (r < L) store1(p.o + ((int64_t(bos) + r) * p.HV + h) * p.V + v0 + c, x);
      });
    }
    {  // S <- Diag(gl) S + kg^T V_new (rows >= L of kg and V_new are zero)
      const int kend = (L + 7) & ~7;
      for (int m0 = 16 * warp; m0 < K; m0 += 16 * (kThreads / 32)) {
        float acc[1][WN][4];
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int d = acc_row(m0, 0, e), c = acc_col(0, j, e);
            acc[0][j][e] = sGl[d] * sS[d * kT8 + c];
          }
        warp_mma<P>(acc, MatT{sKg, KB}, Mat{sVn, kT8}, m0, 0, 0, kend);
        for_each(acc, m0, 0, [&](int d, int c, float x) { sS[d * kT8 + c] = x; });
      }
    }
    __syncthreads();  // S updated; sKg, sAqk, sGl, sVn, sO free
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_b<K>(p.kg + tk * kC * K, p.o ? p.aqk + tk * kC * kC : nullptr, p.gl + tk * K, sKg, sAqk,
                 sGl);
    }
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(p.ht + sbase + int64_t(d) * p.V + c, ld4(sS + d * kT8 + c));
  }
}

}  // namespace

template <class Tin>
void launch_state(const Plan& pl, const StateParams<Tin>& sp, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    with_state_tile(pl, [&](auto bv) {
      constexpr int K = decltype(kc)::value, BV = decltype(bv)::value;
      const size_t smem = size_t(state_smem_floats(K, BV)) * sizeof(float);
      with_prec<kStageState, Tin>(tf32, [&](auto tf32c) {
        constexpr bool F = decltype(tf32c)::value;
        set_smem(kOp, reinterpret_cast<const void*>(&kda_state_kernel<K, BV, Tin, F>), smem,
                 "state kernel");
        kda_state_kernel<K, BV, Tin, F>
            <<<unsigned(pl.N * pl.HV * (pl.V / BV)), kThreads, smem>>>(sp);
      });
      check_launch(kOp, "state kernel");
    });
  });
}

template void launch_state<float>(const Plan&, const StateParams<float>&, unsigned);
template void launch_state<__nv_bfloat16>(const Plan&, const StateParams<__nv_bfloat16>&, unsigned);

}  // namespace hlm::ops::cuda::kda
