// KDA chunked backward on CUDA (ops/kda_chunk_cuda.h; spec kda.md 2.5, 2.6, 3), C = 64: the
// semantics of the CPU ops::kda_chunk_backward (src/ops/cpu/kda_chunk.cpp), stage by stage.
//
// Notation as in kda_chunk.cu (per chunk of L <= C tokens, value head h, rows r, s from the chunk
// start, padded rows exactly zero; S = h[c] the state at the chunk start, dS' = dh[c] the
// gradient w.r.t. the state at the chunk END):
//   B1 recompute (the forward's kernels): G, q^, k^, beta, A_qk, M^-1, W, U, qg, kg, exp(G_L),
//      h[c] and V_new of every chunk.
//   B3 reverse state pass, per (sequence, value head, 32-wide V tile), chunks last to first, dS
//      starting at d_final_state (or 0):
//        dh[c] = dS;  dV_new = A_qk^T dO + kg dS;  dS <- Diag(exp G_L) dS + qg^T dO - W^T dV_new
//      and dinitial_state = the final dS.
//   B4a per (chunk, head, slice of 64 channels), contractions over V:
//        dA_qk = tril_incl(dO V_new^T);  dq = scale exp(G) (dO S^T);  dk = exp(G_L - G) (V_new
//        dS'^T) dW = -dV_new S^T;  dG = q dq - k dk;  dG_{L-1} += sum_r k dk + exp(G_L) rowsum(S .
//        dS')
//   B4b per (chunk, head, side: keys | values), WY backward: dKB = M^-T dW, dVB = M^-T dV_new,
//        dA_kk = -stril(dKB W^T + dVB U^T), dv = beta dVB, dbeta = v.dVB + (exp(G) k).dKB,
//        dk += beta exp(G) dKB, dG += beta exp(G) k dKB (dA_kk and dbeta as per-side partials)
//   B4c per (chunk, head, slice of 64 channels), intra backward from a = scale dA_qk (s <= r)
//      and b = dA_kk (s < r), with E_rs = exp(G_r - G_s) per channel:
//        dq_r += sum_s a_rs k_s E_rs;  R_r = sum_s b_rs k_s E_rs;  dk_r += beta_r R_r;
//        dbeta_r += k_r . R_r;  P_s = sum_r (a_rs q_r + beta_r b_rs k_r) E_rs;  dk_s += P_s;
//        dG_r += q_r dq^intra_r + beta_r k_r R_r;  dG_s -= k_s P_s
//      then dg = reverse cumsum of dG in the chunk, the fused gate's chain rule (dz, per-chunk
//      partial sums of dA_log and d dt_bias); dbeta^intra and dA_log as per-slice partials.
//   B5 per (chunk, qk head): dq, dk summed over the value heads of the group in order, then the
//      L2-norm backward dx = rstd (dx^ - x^ (x^ . dx^)); dbeta = the WY part + the slices'
//      partials, then the beta sigmoid's chain rule.
//   B6 per value head: dA_log, d dt_bias = the per-chunk partials summed in chunk order.
//
// exp safety (spec 2.6), as in the forward: exp(-G) alone is never formed. B4c splits E_rs per
// 16-row block i with the reference row n = 16 i: E_rs = exp(G_r - G_n) exp(G_n - G_s), both
// factors <= 1 for s < n (off-diagonal blocks); inside the diagonal block the split is used while
// its span max_d (G_n - G_s) <= 80 nats (both factors finite and normal; the coefficients above
// the diagonal are exact zeros, never multiplied with an infinite factor), otherwise E_rs is
// formed per element for s <= r only. The other factors are exp(G) and exp(G_L - G), <= 1.
//
// Determinism: no atomics; every reduction has a fixed order (per-thread loops, butterfly
// shuffles over fixed lanes, chunk-ordered sums of partials); every per-token result depends only
// on its own chunk's data and its sequence's state chain, so a sequence gets the same bits alone
// as in a packed batch. FP32 states and workspace; the matrix products on tensor cores
// (mma_tf32.cuh: TF32 operands, 3xTF32 in the intra backward and with exact_bf16_products, FP32
// accumulation, for bf16 inputs; FP32 FMA for f32), the
// elementwise work in FP32.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "ops/cuda/kda_chunk_common.cuh"
#include "ops/cuda/mma_tf32.cuh"
#include "ops/kda_chunk_cuda.h"

namespace hlm::ops {
namespace {

using namespace kda_cu;

constexpr const char* kOp = "kda_chunk_backward_cuda";
constexpr int kC = 64;            // chunk size
constexpr int kSub = 16;          // block size of the intra split
constexpr int kThreads = 256;     // every kernel
constexpr float kSpanMax = 80.f;  // as the forward: largest diagonal-block span for the split
constexpr int kSliceK = 64;       // channels per block of the contractions and the intra backward

// Channels per block of the channel-split kernels, and blocks per (chunk, head): K = 128 -> 2.
__host__ __device__ constexpr int slice_k(int K) {
  return K < kSliceK ? K : kSliceK;
}
__host__ __device__ constexpr int slices(int K) {
  return K / slice_k(K);
}

static_assert(kKdaChunk == kC, "the CUDA kernels are written for C = 64");

enum GateKind : int { kGateNone = 0, kGateStandard = 1, kGateLowerBound = 2 };

// ------------------------------------------------------------------ parameter block

// One block shared by all backward kernels. task = chunk * HV + h.
template <class Tin>
struct BwdParams {
  // inputs
  const Tin* q;            // [T, H, K] raw
  const Tin* k;            // [T, H, K] raw
  const Tin* v;            // [T, HV, V]
  const Tin* z;            // [T, HV, K] the raw gate input (gate != none)
  const Tin* dO;           // [T, HV, V]
  const float* dht;        // [N, HV, K, V] or null (zeros)
  const float* A_log;      // [HV] or null
  const float* dt_bias;    // [HV * K] or null
  const int* chunk_bos;    // [NC]
  const int* chunk_len;    // [NC]
  const int* first_chunk;  // [N+1]
  // recomputed forward intermediates
  const float *qg, *kg, *w, *u, *aqk, *gl, *G, *qn, *kn, *beta, *minv, *h, *vnew;
  // backward workspace
  float* dvnew;  // [NC, HV, C, V]
  float* dh;     // [NC, HV, K, V] gradient w.r.t. the state at the end of each chunk
  float* daqk;   // [NC, HV, C, C]
  float* dakk;   // [NC, HV, C, C] X_K = dKB W^T (the WY backward's key side)
  float* dakv;   // [NC, HV, C, C] X_V = dVB U^T (value side); dA_kk = -stril(X_K + X_V)
  float* dw;     // [NC, HV, C, K]
  float* dq;     // [NC, HV, C, K] per value head
  float* dk;     // [NC, HV, C, K] per value head
  float* dG;     // [NC, HV, C, K] gradient w.r.t. G
  float* dbw;    // [NC, HV, 2, C] dbeta from the WY backward (key side, value side)
  float* dbi;    // [NC, HV, NS, C] intra dbeta per channel slice of the intra backward
  float* pA;     // [NC, HV, NS] dA_log partials (per channel slice)
  float* pdt;    // [NC, HV, K] d dt_bias partials
  // outputs (f32)
  float* o_dq;     // [T, H, K]
  float* o_dk;     // [T, H, K]
  float* o_dv;     // [T, HV, V]
  float* o_dg;     // [T, HV, K]
  float* o_dbeta;  // [T, HV]
  float* o_dh0;    // [N, HV, K, V]
  float* o_dA;     // [HV] or null
  float* o_ddt;    // [HV * K] or null
  int NC, H, HV, V;
  float scale;
  int gate;
  float lower_bound;
  bool l2norm, beta_logits;
};

// ------------------------------------------------------------------ device helpers

// Copies rows x cols floats (cols % 4 == 0) from global (row stride gs) to shared (row stride ss,
// ss % 4 == 0) by cp.async; the caller commits and waits.
__device__ __forceinline__ void cp_rows(float* dst, int ss, const float* src, int64_t gs, int rows,
                                        int cols) {
  const int c4 = cols / 4;
  for (int i = threadIdx.x; i < rows * c4; i += kThreads) {
    const int r = i / c4, c = 4 * (i % c4);
    cp_async16(dst + r * ss + c, src + r * gs + c);
  }
}

// ------------------------------------------------------------------ B3: reverse state pass

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

// ------------------------------------------------------------------ B4a: contractions over V

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

// ------------------------------------------------------------------ B4b: WY backward

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

// ------------------------------------------------------------------ B4c: intra backward + finish

constexpr int kWarps = kThreads / 32;
constexpr int kAP2 = kC + 4;  // row stride of dA_qk, dA_kk in the intra backward (A = Mat / MatT)

// Row strides: KH + 8 for the [C][KH] arrays (Y, Xq, Xk are read as B = Mat). The column sums P
// live in registers and land in Y's place at the end. K = 128, V = 128: ~100 KB, two blocks per SM.
struct IntraBwdLayout {
  int g, kk, ca, cb, xq, xk, y, beta, dbi, red, rp, total;
  __host__ __device__ IntraBwdLayout(int K) {
    const int KP = slice_k(K) + 8;
    g = 0;                // G      [C][KP]
    kk = g + kC * KP;     // k^     [C][KP]
    ca = kk + kC * KP;    // scale dA_qk [C][kAP2]
    cb = ca + kC * kAP2;  // dA_kk  [C][kAP2]
    xq = cb + kC * kAP2;  // Xq     [16][KP]
    xk = xq + kSub * KP;  // Xk     [16][KP] (beta_r included)
    y = xk + kSub * KP;   // Y      [C][KP], at the end P
    beta = y + kC * KP;   // beta   [C]
    dbi = beta + kC;      // intra dbeta over the block's channels [C]
    red = dbi + kC;       // [KH] dA_log partials per channel
    rp = red + K;         // [KH / 8 <= warps][16] intra dbeta partials of a block row
    total = rp + kWarps * kSub;
  }
};

// Block (chunk, value head, channel slice z): channels c_lo = KH z .. c_lo + KH - 1. Everything
// but dbeta and dA_log is per channel; their sums over the channels leave as per-slice partials
// (dbi, pA), which the GVA kernel (dbeta) and the gate-sum kernel (dA_log) add in slice order.
template <int K, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2) kda_bwd_intra_kernel(const BwdParams<Tin> p) {
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KH = slice_k(K), NS = slices(K), KP = KH + 8;
  // P: 16 x 16 tiles [C / 16][TN], NPT per warp of the column side (kSide warps)
  constexpr int kSide = kWarps / 2, TN = KH / 16, NPT = 4 * TN / kSide;
  static_assert(NPT >= 1 && (4 * TN) % kSide == 0, "whole P tiles per warp");
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const IntraBwdLayout lay(K);
  float* sG = smem + lay.g;
  float* sK = smem + lay.kk;
  float* sCA = smem + lay.ca;
  float* sCB = smem + lay.cb;
  float* sXq = smem + lay.xq;
  float* sXk = smem + lay.xk;
  float* sY = smem + lay.y;
  float* sBeta = smem + lay.beta;
  float* sDbI = smem + lay.dbi;
  float* sRed = smem + lay.red;
  float* sRowPart = smem + lay.rp;

  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int ci = blockIdx.x, h = blockIdx.y, z = blockIdx.z, c_lo = KH * z;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int64_t tk = int64_t(ci) * p.HV + h;
  // [C][K] global arrays of the task, offset to the slice's first channel (row stride K)
  const float* qn = p.qn + tk * kC * K + c_lo;
  float* dq = p.dq + tk * kC * K + c_lo;
  float* dk = p.dk + tk * kC * K + c_lo;
  float* dG = p.dG + tk * kC * K + c_lo;

  cp_rows(sG, KP, p.G + tk * kC * K + c_lo, K, kC, KH);
  cp_rows(sK, KP, p.kn + tk * kC * K + c_lo, K, kC, KH);
  cp_async_commit();
  for (int i = t; i < kC * kC / 4; i += kThreads) {  // four columns per step
    const int r = i / (kC / 4), s = 4 * (i % (kC / 4));
    const int64_t o = tk * kC * kC + 4 * i;
    const float4 a = ld4(p.daqk + o), b = ld4(p.dakk + o), c = ld4(p.dakv + o);
    st4(sCA + r * kAP2 + s,
        make_float4(p.scale * a.x, p.scale * a.y, p.scale * a.z, p.scale * a.w));
    st4(sCB + r * kAP2 + s,
        make_float4(s < r ? -(b.x + c.x) : 0.f, s + 1 < r ? -(b.y + c.y) : 0.f,
                    s + 2 < r ? -(b.z + c.z) : 0.f, s + 3 < r ? -(b.w + c.w) : 0.f));
  }
  if (t < kC) sBeta[t] = p.beta[tk * kC + t], sDbI[t] = 0.f;
  cp_async_wait<0>();
  __syncthreads();

  // P tiles of column-side warp kSide + w': tile w' + kSide m -> rows 16 (tile / TN) .., channels
  // 16 (tile % TN) ..
  float pacc[NPT][1][2][4];
#pragma unroll
  for (int m = 0; m < NPT; ++m) zero(pacc[m]);

  for (int ib = 0; ib < kC / kSub; ++ib) {
    const int n = kSub * ib, ncol = n + kSub;
    // Xq_r = q_r exp(G_r - G_n), Xk_r = beta_r k_r exp(G_r - G_n) (rows of block ib),
    // Y_s = k_s exp(G_n - G_s) (s < n + 16)
    // Four channels per thread: the sweep's rows 0..15 are Xq / Xk (rows n..n+15, where the
    // diagonal block's span is checked too), rows 16.. are Y (rows 0..ncol-1). The forward intra
    // kernel's loop has the same shape over other operands (raw q / k rows with their norm
    // factors, no beta), so the two are written out.
    bool wide = false;
    {
      constexpr int C4 = KH / 4, RPS = kThreads / C4;
      static_assert(RPS % 2 == 0 && 32 % C4 == 0, "warp-uniform X / Y rows");
      const int c = 4 * (t % C4);
      alignas(16) float gn[4];
      ld16(sG + n * KP + c, gn);
      for (int row = t / C4; row < kSub + ncol; row += RPS) {
        alignas(16) float G[4], kv[4], y[4];
        if (row < kSub) {
          const int r = n + row;
          alignas(16) float qv[4], xq[4];
          ld16(sG + r * KP + c, G);
          ld16(sK + r * KP + c, kv);
          ld16(qn + r * K + c, qv);
          const float br = sBeta[r];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            wide |= !(fabsf(gn[e] - G[e]) <= kSpanMax);
            const float ee = exp_in<Tin>(G[e] - gn[e]);
            xq[e] = qv[e] * ee;
            y[e] = br * kv[e] * ee;
          }
          st16(sXq + row * KP + c, xq);
          st16(sXk + row * KP + c, y);
        } else {
          const int s2 = row - kSub;
          ld16(sG + s2 * KP + c, G);
          ld16(sK + s2 * KP + c, kv);
#pragma unroll
          for (int e = 0; e < 4; ++e) y[e] = kv[e] * exp_in<Tin>(gn[e] - G[e]);
          st16(sY + s2 * KP + c, y);
        }
      }
    }
    // Also the barrier for X, Y. A slice decides for its own channels: the split and the
    // per-element sum are two exact forms of the same terms.
    const bool per_element = __syncthreads_or(wide) != 0;
    const int send = per_element ? n : ncol;  // columns taken by the split product

    // Two sides of four warps, both reading only X, Y, CA, CB, G, k^ and writing disjoint
    // outputs:
    //   row side (w < 4), rows r = n .. n + 15: dq^intra_r = E_rn sum_{s < send} a_rs Y_s and
    //     R_r = E_rn sum_s b_rs Y_s (E_rn = exp(G_r - G_n)) on tensor cores, one Y fragment for
    //     both; warp w owns channels 16 w .. 16 w + 15;
    //   column side (w >= 4): the P tiles (below), warp 4 + w' owning tiles w', w' + 4, ...
    if (warp < kSide) {
      float dbr[2][2] = {};  // k_r . R_r per 8-channel group j, rows g and g + 8
      for (int c0 = 16 * warp; c0 < KH; c0 += 16 * kSide) {
        // The global dq, dk, dG, q^ of the tile's elements, loaded before the products (the
        // stores below could otherwise serialise them).
        float gq[2][4], gk[2][4], gG[2][4], gqn[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(n, 0, e), d = acc_col(c0, j, e);
            const bool in = r < L;
            gq[j][e] = in ? dq[r * K + d] : 0.f;
            gk[j][e] = in ? dk[r * K + d] : 0.f;
            gG[j][e] = in ? dG[r * K + d] : 0.f;
            gqn[j][e] = in ? qn[r * K + d] : 0.f;
          }
        float aq[1][2][4], ab[1][2][4];
        zero(aq);
        zero(ab);
        warp_mma_pair<P>(aq, Mat{sCA, kAP2}, ab, Mat{sCB, kAP2}, Mat{sY, KP}, n, c0, 0, send);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(n, 0, e), d = acc_col(c0, j, e);
            const float E = exp_in<Tin>(sG[r * KP + d] - sG[n * KP + d]);
            float dqi = E * aq[0][j][e], R = E * ab[0][j][e];
            if (per_element) {  // the diagonal block, exp(G_r - G_s) per element for s <= r
              for (int s2 = n; s2 <= r; ++s2) {
                const float kE = sK[s2 * KP + d] * exp_in<Tin>(sG[r * KP + d] - sG[s2 * KP + d]);
                dqi = fmaf(sCA[r * kAP2 + s2], kE, dqi);
                R = fmaf(sCB[r * kAP2 + s2], kE, R);
              }
            }
            const float kr = sK[r * KP + d], br = sBeta[r];
            dbr[j][e >> 1] = fmaf(kr, R, dbr[j][e >> 1]);
            if (r < L) {
              dq[r * K + d] = gq[j][e] + dqi;
              dk[r * K + d] = gk[j][e] + br * R;
              dG[r * K + d] = gG[j][e] + (gqn[j][e] * dqi + br * kr * R);
            }
          }
      }
      // One partial per 8-channel group (over the 4 lanes t of a row), summed in group order
      // after the barrier. KH <= 16 kSide: one pass of the loop above.
      static_assert(slice_k(K) <= 16 * kSide, "one channel pass per warp");
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          dbr[j][e] += __shfl_xor_sync(0xffffffffu, dbr[j][e], 1);
          dbr[j][e] += __shfl_xor_sync(0xffffffffu, dbr[j][e], 2);
        }
      if ((lane & 3) == 0 && 16 * warp < KH) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          sRowPart[(2 * warp + j) * kSub + (lane >> 2)] = dbr[j][0];
          sRowPart[(2 * warp + j) * kSub + (lane >> 2) + 8] = dbr[j][1];
        }
      }
    } else {
      // columns s < send: P_s += exp(G_n - G_s) sum_{a < 16} (a_{n+a, s} Xq_a + b_{n+a, s} Xk_a),
      // tensor cores, into the warp's P tiles; with per_element, the diagonal block's columns
      // s = n .. n + 15 per element instead (rows r = s .. n + 15), in the same tiles.
#pragma unroll
      for (int m = 0; m < NPT; ++m) {
        const int tile = (warp - kSide) + kSide * m, m0 = 16 * (tile / TN), c0 = 16 * (tile % TN);
        if (m0 < send) {
          float acc[1][2][4];
          zero(acc);
          warp_mma<P>(acc, MatT{sCA + n * kAP2, kAP2}, Mat{sXq, KP}, m0, c0, 0, kSub);
          warp_mma<P>(acc, MatT{sCB + n * kAP2, kAP2}, Mat{sXk, KP}, m0, c0, 0, kSub);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int s2 = acc_row(m0, 0, e), d = acc_col(c0, j, e);
              pacc[m][0][j][e] += exp_in<Tin>(sG[n * KP + d] - sG[s2 * KP + d]) * acc[0][j][e];
            }
        } else if (per_element && m0 == n) {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int s = acc_row(m0, 0, e), d = acc_col(c0, j, e);
              float acc = 0.f;
              for (int r = s; r < ncol; ++r) {
                const float E = exp_in<Tin>(sG[r * KP + d] - sG[s * KP + d]);
                const float c = sCA[r * kAP2 + s] * qn[r * K + d] +
                                sBeta[r] * sCB[r * kAP2 + s] * sK[r * KP + d];
                acc = fmaf(c, E, acc);
              }
              pacc[m][0][j][e] += acc;
            }
        }
      }
    }
    __syncthreads();  // X, Y free for the next block row; the row updates complete
    if (t < kSub) {   // intra dbeta of the block's rows: the groups' partials in channel order
      float db = 0.f;
      for (int w = 0; w < KH / 8; ++w) db += sRowPart[w * kSub + t];
      sDbI[n + t] = db;
    }
  }
  float* sP = sY;  // [C][KP] (Y is free after the last block row's barrier)
  if (warp >= kSide) {
#pragma unroll
    for (int m = 0; m < NPT; ++m) {
      const int tile = (warp - kSide) + kSide * m, m0 = 16 * (tile / TN), c0 = 16 * (tile % TN);
      for_each(pacc[m], m0, c0, [&](int s, int d, float x) { sP[s * KP + d] = x; });
    }
  }
  __syncthreads();

  // dk_s += P_s; dG_s -= k_s P_s (all threads, in place in P); dg = reverse cumsum of dG (one
  // thread per channel, rows last to first, in shared memory); the gate's chain rule (all
  // threads: thread t takes channel t % KH of the rows t / KH, t / KH + NT / KH, ..., so the dz
  // and dA_log sums run per thread, then over the NT / KH row groups in order).
  // (Four channels per step, batches of kTB4 steps per thread: the global loads of a batch come
  // before its stores.)
  {
    constexpr int kTB4 = 4, G4 = KH / 4;
    for (int i0 = t; i0 < L * G4; i0 += kTB4 * kThreads) {
      float4 gdk[kTB4], gdG[kTB4];
#pragma unroll
      for (int b = 0; b < kTB4; ++b) {
        const int i = i0 + b * kThreads, r = i / G4, d = 4 * (i % G4);
        if (i < L * G4) gdk[b] = ld4(dk + r * K + d), gdG[b] = ld4(dG + r * K + d);
      }
#pragma unroll
      for (int b = 0; b < kTB4; ++b) {
        const int i = i0 + b * kThreads, r = i / G4, d = 4 * (i % G4);
        if (i < L * G4) {
          const float4 Pv = ld4(sP + r * KP + d), kv = ld4(sK + r * KP + d);
          st4(dk + r * K + d,
              make_float4(gdk[b].x + Pv.x, gdk[b].y + Pv.y, gdk[b].z + Pv.z, gdk[b].w + Pv.w));
          st4(sP + r * KP + d, make_float4(gdG[b].x - kv.x * Pv.x, gdG[b].y - kv.y * Pv.y,
                                           gdG[b].z - kv.z * Pv.z, gdG[b].w - kv.w * Pv.w));
        }
      }
    }
  }
  __syncthreads();
  if (t < KH) {  // rows in batches of 8: the batch's loads issue together, then its sums in order
    float acc = 0.f;
    int r = L - 1;
    for (; r >= 7; r -= 8) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = sP[(r - j) * KP + t];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc += v[j];
        sP[(r - j) * KP + t] = acc;
      }
    }
    for (; r >= 0; --r) {
      acc += sP[r * KP + t];
      sP[r * KP + t] = acc;
    }
  }
  __syncthreads();
  {
    static_assert(kThreads % KH == 0, "whole row groups");
    constexpr int NG = kThreads / KH;
    const int d = t % KH, g0 = t / KH, dc = c_lo + d;
    const float eA = (p.gate != kGateNone && p.A_log) ? expf(p.A_log[h]) : 1.f;
    const float bias = (p.gate != kGateNone && p.dt_bias) ? p.dt_bias[h * K + dc] : 0.f;
    float sdt = 0.f, sA = 0.f;
    constexpr int kTB = 8;  // rows per thread and batch: the batch's z loads before its work
    // The loop once per gate kind (kind a constant: no per-element branch on it).
    auto chain = [&](auto kind_c) {
      constexpr int kind = decltype(kind_c)::value;
      for (int r0 = g0; r0 < L; r0 += kTB * NG) {
        float gz[kTB];
#pragma unroll
        for (int b = 0; b < kTB; ++b) {
          const int r = r0 + b * NG;
          gz[b] = (kind != kGateNone && r < L) ? to_f(p.z[((int64_t(bos) + r) * p.HV + h) * K + dc])
                                               : 0.f;
        }
#pragma unroll
        for (int b = 0; b < kTB; ++b) {
          const int r = r0 + b * NG;
          if (r >= L) break;
          const float acc = sP[r * KP + d];
          const int64_t oi = ((int64_t(bos) + r) * p.HV + h) * K + dc;
          float out = acc;
          if constexpr (kind != kGateNone) {
            const float x = gz[b] + bias;
            float dz, dae;
            if constexpr (kind == kGateStandard) {
              const float sp = x > 20.f ? x : log1pf(expf(x));
              const float g = -mul0(eA, sp);
              dz = -mul0(mul0(eA, sigmoid_f(x)), acc);
              dae = mul0(acc, g);
            } else {
              const float y = mul0(eA, x);
              // sigmoid(y) sigmoid(-y) = e / (1 + e)^2 with e = exp(-|y|): one exp, one
              // reciprocal
              const float e = exp_in<Tin>(-fabsf(y)), rc = rcp_in<Tin>(1.f + e);
              const float ds = e * rc * rc;
              dz = mul0(mul0(acc * p.lower_bound, ds), eA);
              dae = mul0(dz, x);
            }
            out = dz;
            sdt += dz;
            sA += dae;
          }
          p.o_dg[oi] = out;
        }
      }
    };
    if (p.gate == kGateLowerBound)
      chain(std::integral_constant<int, kGateLowerBound>{});
    else if (p.gate == kGateStandard)
      chain(std::integral_constant<int, kGateStandard>{});
    else
      chain(std::integral_constant<int, kGateNone>{});
    if (p.gate != kGateNone) {
      float* part = sXq;  // [2][NG][KH] (X is free; 2 NT <= 32 KP)
      static_assert(2 * kThreads <= 2 * kSub * (KH + 8), "partials fit in Xq, Xk");
      part[g0 * KH + d] = sdt;
      part[(NG + g0) * KH + d] = sA;
      __syncthreads();
      if (t < KH) {
        float s1 = 0.f, s2 = 0.f;
        for (int g = 0; g < NG; ++g) s1 += part[g * KH + t], s2 += part[(NG + g) * KH + t];
        p.pdt[tk * K + c_lo + t] = s1;
        sRed[t] = s2;
      }
    }
  }
  if (t < kC) p.dbi[(tk * NS + z) * kC + t] = t < L ? sDbI[t] : 0.f;
  if (p.gate != kGateNone) {
    __syncthreads();
    if (t == 0) {
      float s = 0.f;
      for (int d = 0; d < KH; ++d) s += sRed[d];
      p.pA[tk * NS + z] = s;
    }
  }
}

// ------------------------------------------------------------------ B5: GVA sum + L2 norm

template <int K, class Tin>
__global__ void __launch_bounds__(kThreads) kda_bwd_qk_kernel(const BwdParams<Tin> p) {
  constexpr int NB = K / 32;
  const int ci = blockIdx.x, hk = blockIdx.y;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int Gq = p.HV / p.H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < L; r += kThreads / 32) {
    const int64_t tok = int64_t(bos) + r;
    for (int which = 0; which < 2; ++which) {
      const float* src = which ? p.dk : p.dq;
      float dx[NB];
#pragma unroll
      for (int b = 0; b < NB; ++b) dx[b] = 0.f;
      for (int g = 0; g < Gq; ++g) {  // the value heads of the group, in order
        const float* row = src + ((int64_t(ci) * p.HV + hk * Gq + g) * kC + r) * K;
#pragma unroll
        for (int b = 0; b < NB; ++b) dx[b] += row[lane + 32 * b];
      }
      float* out = (which ? p.o_dk : p.o_dq) + (tok * p.H + hk) * K;
      if (p.l2norm) {
        const Tin* xr = (which ? p.k : p.q) + (tok * p.H + hk) * K;
        float x[NB], ss = 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          x[b] = to_f(xr[lane + 32 * b]);
          ss = fmaf(x[b], x[b], ss);
        }
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float rs = 1.f / sqrtf(ss + float(kKdaL2Eps));
        float dot = 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          x[b] *= rs;
          dot = fmaf(x[b], dx[b], dot);
        }
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
#pragma unroll
        for (int b = 0; b < NB; ++b) out[lane + 32 * b] = rs * (dx[b] - x[b] * dot);
      } else {
#pragma unroll
        for (int b = 0; b < NB; ++b) out[lane + 32 * b] = dx[b];
      }
    }
  }
  // dbeta of the group's value heads = the WY part + the intra slices' partials (in slice
  // order), then the beta sigmoid's chain rule.
  constexpr int NS = slices(K);
  for (int i = threadIdx.x; i < Gq * L; i += kThreads) {
    const int g = i / L, r = i % L, hv = hk * Gq + g;
    const int64_t tk = int64_t(ci) * p.HV + hv;
    float di = 0.f;
    for (int zs = 0; zs < NS; ++zs) di += p.dbi[(tk * NS + zs) * kC + r];
    float db = (p.dbw[(tk * 2 + 1) * kC + r] + p.dbw[tk * 2 * kC + r]) + di;
    if (p.beta_logits) {
      const float b = p.beta[tk * kC + r];
      db *= b * (1.f - b);
    }
    p.o_dbeta[(int64_t(bos) + r) * p.HV + hv] = db;
  }
}

// ------------------------------------------------------------------ B6: gate parameter sums

template <int K, class Tin>
__global__ void __launch_bounds__(kThreads) kda_bwd_gate_sum_kernel(const BwdParams<Tin> p) {
  const int h = blockIdx.x, t = threadIdx.x;
  if (p.o_ddt && t < K) {
    float s = 0.f;
    for (int ci = 0; ci < p.NC; ++ci) s += p.pdt[(int64_t(ci) * p.HV + h) * K + t];
    p.o_ddt[h * K + t] = s;
  }
  if (p.o_dA && t == 0) {
    float s = 0.f;
    constexpr int NS = slices(K);
    for (int ci = 0; ci < p.NC; ++ci)
      for (int z = 0; z < NS; ++z) s += p.pA[(int64_t(ci) * p.HV + h) * NS + z];
    p.o_dA[h] = s;
  }
}

// ------------------------------------------------------------------ host side

void require_cuda(const Tensor& t, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", kOp, what);
  HLM_CHECK(t.device() == Device::cuda, "{}: {} must be a CUDA tensor, got {}", kOp, what,
            t.describe());
  HLM_CHECK(t.is_contiguous(), "{}: {} must be contiguous, got {}", kOp, what, t.describe());
  HLM_CHECK(aligned16(t), "{}: {} must be 16-byte aligned", kOp, what);
}

// Workspace offsets in floats (multiples of 64), in two regions: the forward intermediates
// (meta .. ht: `saved`, written by the recompute or kept from the forward) at offset 0 of their
// base, and the backward's scratch (dvnew .. pdt) at offset 0 of theirs. One workspace holds both,
// the scratch at `saved`; with the forward's saved buffer the workspace holds the scratch alone.
struct Layout {
  int64_t meta, qg, kg, w, u, aqk, gl, G, qn, kn, beta, minv, h, vnew, ht, saved;
  int64_t dvnew, dh, daqk, dakk, dakv, dw, dq, dk, dG, dbw, dbi, pA, pdt, scratch;
};

Layout make_layout(const kda_cuda_detail::Plan& p) {
  const int64_t tasks = p.NC * p.HV, C = kC;
  Layout l;
  int64_t off = 0;
  auto take = [&](int64_t floats) {
    const int64_t o = off;
    off = round_up(off + floats, 64);
    return o;
  };
  l.meta = take(int64_t(p.meta.size()));
  l.qg = take(tasks * C * p.K);
  l.kg = take(tasks * C * p.K);
  l.w = take(tasks * C * p.K);
  l.u = take(tasks * C * p.V);
  l.aqk = take(tasks * C * C);
  l.gl = take(tasks * p.K);
  l.G = take(tasks * C * p.K);
  l.qn = take(tasks * C * p.K);
  l.kn = take(tasks * C * p.K);
  l.beta = take(tasks * C);
  l.minv = take(tasks * C * C);
  l.h = take(tasks * p.K * p.V);
  l.vnew = take(tasks * C * p.V);
  l.ht = take(p.N * p.HV * p.K * p.V);
  l.saved = off;
  off = 0;
  l.dvnew = take(tasks * C * p.V);
  l.dh = take(tasks * p.K * p.V);
  l.daqk = take(tasks * C * C);
  l.dakk = take(tasks * C * C);
  l.dakv = take(tasks * C * C);
  l.dw = take(tasks * C * p.K);
  l.dq = take(tasks * C * p.K);
  l.dk = take(tasks * C * p.K);
  l.dG = take(tasks * C * p.K);
  l.dbw = take(tasks * 2 * C);
  l.dbi = take(tasks * slices(int(p.K)) * C);
  l.pA = take(tasks * slices(int(p.K)));
  l.pdt = take(tasks * p.K);
  l.scratch = off;
  return l;
}

// Opt-in stage timing (environment variable HLM_KDA_BWD_PROFILE set): cudaEvents between the
// stages, printed to stderr at the end of the call.
struct Profile {
  bool on = std::getenv("HLM_KDA_BWD_PROFILE") != nullptr;
  std::vector<std::pair<const char*, cudaEvent_t>> marks;
  void mark(const char* name) {
    if (!on) return;
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e);
    marks.push_back({name, e});
  }
  ~Profile() {
    if (!on || marks.empty()) return;
    cudaEventSynchronize(marks.back().second);
    std::fprintf(stderr, "%s stages:", kOp);
    for (size_t i = 1; i < marks.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second);
      std::fprintf(stderr, " %s %.3f ms;", marks[i].first, ms);
    }
    std::fprintf(stderr, "\n");
    for (auto& m : marks) cudaEventDestroy(m.second);
  }
};

template <int K, class Tin>
void launch_bwd(const kda_cuda_detail::Plan& pl, const BwdParams<Tin>& bp, bool exact,
                Profile& prof) {
  const unsigned nc = unsigned(pl.NC), hv = unsigned(pl.HV);
  {
    auto launch = [&](auto bv) {
      constexpr int BV = decltype(bv)::value;
      const size_t smem = size_t(state_bwd_smem_floats(K, BV)) * sizeof(float);
      with_prec<kStageStateBwd, Tin>(exact, [&](auto tf32) {
        constexpr bool F = decltype(tf32)::value;
        set_smem(kOp, reinterpret_cast<const void*>(&kda_state_bwd_kernel<K, BV, Tin, F>), smem,
                 "state bwd");
        kda_state_bwd_kernel<K, BV, Tin, F>
            <<<unsigned(pl.N * pl.HV * (pl.V / BV)), kThreads, smem>>>(bp);
      });
      check_launch(kOp, "state bwd kernel");
    };
    if (kda_cuda_detail::state_tile(pl) == 64)
      launch(std::integral_constant<int, 64>{});
    else
      launch(std::integral_constant<int, 32>{});
    prof.mark("state-bwd");
  }
  if (pl.NC > 0) {
    size_t smem = size_t(sp_smem_floats<Tin>(int(pl.V))) * sizeof(float);
    with_prec<kStageProducts, Tin>(exact, [&](auto tf32) {
      constexpr bool F = decltype(tf32)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_state_products_kernel<K, Tin, F>), smem,
               "state products");
      kda_bwd_state_products_kernel<K, Tin, F>
          <<<dim3(nc, hv, unsigned(slices(K))), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "state products kernel");
    prof.mark("state-products");
    smem = size_t(wy_smem_floats(K, int(pl.V))) * sizeof(float);
    with_prec<kStageWy, Tin>(exact, [&](auto tf32) {
      constexpr bool F = decltype(tf32)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_wy_kernel<K, Tin, F>), smem, "wy bwd");
      kda_bwd_wy_kernel<K, Tin, F><<<dim3(nc, hv, 2), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "wy bwd kernel");
    prof.mark("wy-bwd");
    smem = size_t(IntraBwdLayout(K).total) * sizeof(float);
    with_prec<kStageIntraBwd, Tin>(exact, [&](auto tf32) {
      constexpr bool F = decltype(tf32)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_intra_kernel<K, Tin, F>), smem,
               "intra bwd");
      kda_bwd_intra_kernel<K, Tin, F><<<dim3(nc, hv, unsigned(slices(K))), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "intra bwd kernel");
    prof.mark("intra-bwd");
    kda_bwd_qk_kernel<K, Tin><<<dim3(nc, unsigned(pl.H)), kThreads>>>(bp);
    check_launch(kOp, "qk bwd kernel");
    prof.mark("qk-gva-l2norm");
  }
  if (bp.o_dA || bp.o_ddt) {
    kda_bwd_gate_sum_kernel<K, Tin><<<hv, kThreads>>>(bp);
    check_launch(kOp, "gate sum kernel");
    prof.mark("gate-sums");
  }
}

template <class Tin>
void run_bwd(const kda_cuda_detail::Plan& pl, const KdaArgs& a, const Tensor& d_o,
             const Tensor& d_final, const kda_cuda_detail::Intermediates& x, float* ws,
             const Layout& l, KdaGrads& g, Profile& prof) {
  BwdParams<Tin> bp{};
  bp.q = static_cast<const Tin*>(a.q.raw());
  bp.k = static_cast<const Tin*>(a.k.raw());
  bp.v = static_cast<const Tin*>(a.v.raw());
  bp.z = static_cast<const Tin*>(a.g.raw());
  bp.dO = static_cast<const Tin*>(d_o.raw());
  bp.dht = d_final.defined() ? d_final.data<float>() : nullptr;
  bp.A_log = (a.gate && a.A_log.defined()) ? a.A_log.data<float>() : nullptr;
  bp.dt_bias = (a.gate && a.dt_bias.defined()) ? a.dt_bias.data<float>() : nullptr;
  bp.chunk_bos = x.meta;
  bp.chunk_len = x.meta + pl.NC;
  bp.first_chunk = x.meta + 2 * pl.NC;
  bp.qg = x.qg, bp.kg = x.kg, bp.w = x.w, bp.u = x.u;
  bp.aqk = x.aqk, bp.gl = x.gl, bp.G = x.G, bp.qn = x.qn;
  bp.kn = x.kn, bp.beta = x.beta, bp.minv = x.minv, bp.h = x.h;
  bp.vnew = x.vnew;
  bp.dvnew = ws + l.dvnew, bp.dh = ws + l.dh, bp.daqk = ws + l.daqk, bp.dakk = ws + l.dakk;
  bp.dakv = ws + l.dakv;
  bp.dw = ws + l.dw, bp.dq = ws + l.dq, bp.dk = ws + l.dk, bp.dG = ws + l.dG;
  bp.dbw = ws + l.dbw, bp.dbi = ws + l.dbi, bp.pA = ws + l.pA, bp.pdt = ws + l.pdt;
  bp.o_dq = g.dq.data<float>();
  bp.o_dk = g.dk.data<float>();
  bp.o_dv = g.dv.data<float>();
  bp.o_dg = g.dg.data<float>();
  bp.o_dbeta = g.dbeta.data<float>();
  bp.o_dh0 = g.dinitial_state.data<float>();
  bp.o_dA = g.dA_log.defined() ? g.dA_log.data<float>() : nullptr;
  bp.o_ddt = g.ddt_bias.defined() ? g.ddt_bias.data<float>() : nullptr;
  bp.NC = int(pl.NC), bp.H = int(pl.H), bp.HV = int(pl.HV), bp.V = int(pl.V);
  bp.scale = pl.scale;
  bp.gate = !a.gate                            ? kGateNone
            : *a.gate == KdaGateKind::standard ? kGateStandard
                                               : kGateLowerBound;
  bp.lower_bound = float(a.lower_bound);
  bp.l2norm = a.use_qk_l2norm;
  bp.beta_logits = a.beta_logits;
  switch (pl.K) {
    case 32:
      return launch_bwd<32, Tin>(pl, bp, a.exact_bf16_products, prof);
    case 64:
      return launch_bwd<64, Tin>(pl, bp, a.exact_bf16_products, prof);
    case 128:
      return launch_bwd<128, Tin>(pl, bp, a.exact_bf16_products, prof);
    default:
      HLM_FAIL("{}: unsupported K={}", kOp, pl.K);
  }
}

// A caller buffer (checked) or a fresh f32 CUDA tensor.
Tensor output(const Tensor& given, const Shape& shape, const char* what) {
  return output_buffer(given, DType::f32, shape, kOp, what);
}

}  // namespace

int64_t kda_chunk_bwd_cuda_workspace_floats(const KdaArgs& a, bool saved) {
  const Layout l = make_layout(kda_cuda_detail::plan(a, kOp));
  return saved ? l.scratch : l.saved + l.scratch;
}

int64_t kda_chunk_cuda_saved_floats(const KdaArgs& a) {
  return make_layout(kda_cuda_detail::plan(a, kOp)).saved;
}

namespace kda_cuda_detail {

int64_t saved_floats(const Plan& p) {
  return make_layout(p).saved;
}

Intermediates saved_intermediates(const Plan& p, float* base) {
  const Layout l = make_layout(p);
  Intermediates x;
  x.meta = reinterpret_cast<const int*>(base + l.meta);
  x.qg = base + l.qg, x.kg = base + l.kg, x.w = base + l.w, x.u = base + l.u;
  x.aqk = base + l.aqk, x.gl = base + l.gl, x.G = base + l.G, x.qn = base + l.qn;
  x.kn = base + l.kn, x.beta = base + l.beta, x.minv = base + l.minv, x.h = base + l.h;
  x.vnew = base + l.vnew, x.ht = base + l.ht;
  return x;
}

}  // namespace kda_cuda_detail

KdaGrads kda_chunk_backward_cuda(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state,
                                 const KdaChunkBwdCudaBuffers& buffers) {
  const kda_cuda_detail::Plan pl = kda_cuda_detail::plan(a, kOp);
  const Layout l = make_layout(pl);
  HLM_CHECK(d_o.defined(), "{}: d_o is undefined", kOp);
  require_cuda(d_o, "d_o");
  HLM_CHECK(d_o.dtype() == a.q.dtype() && d_o.shape() == Shape({pl.T, pl.HV, pl.V}),
            "{}: d_o must be {} [{}, {}, {}] (the dtype of q), got {}", kOp,
            dtype_name(a.q.dtype()), pl.T, pl.HV, pl.V, d_o.describe());
  if (d_final_state.defined()) {
    require_cuda(d_final_state, "d_final_state");
    HLM_CHECK(d_final_state.dtype() == DType::f32 &&
                  d_final_state.shape() == Shape({pl.N, pl.HV, pl.K, pl.V}),
              "{}: d_final_state must be f32 [{}, {}, {}, {}], got {}", kOp, pl.N, pl.HV, pl.K,
              pl.V, d_final_state.describe());
  }

  KdaGrads g;
  g.dq = output(buffers.dq, {pl.T, pl.H, pl.K}, "buffers.dq");
  g.dk = output(buffers.dk, {pl.T, pl.H, pl.K}, "buffers.dk");
  g.dv = output(buffers.dv, {pl.T, pl.HV, pl.V}, "buffers.dv");
  g.dg = output(buffers.dg, {pl.T, pl.HV, pl.K}, "buffers.dg");
  g.dbeta = output(buffers.dbeta, {pl.T, pl.HV}, "buffers.dbeta");
  g.dinitial_state =
      output(buffers.dinitial_state, {pl.N, pl.HV, pl.K, pl.V}, "buffers.dinitial_state");
  if (a.gate && a.A_log.defined()) g.dA_log = output(buffers.dA_log, {pl.HV}, "buffers.dA_log");
  if (a.gate && a.dt_bias.defined())
    g.ddt_bias = output(buffers.ddt_bias, {pl.HV * pl.K}, "buffers.ddt_bias");

  const bool saved = buffers.saved.defined(), kept = buffers.kept.defined();
  HLM_CHECK(!(saved && kept), "{}: buffers.saved and buffers.kept are alternatives; give one", kOp);
  const Tensor ws = workspace_buffer(buffers.workspace, saved ? l.scratch : l.saved + l.scratch,
                                     kOp, "buffers.workspace");
  Profile prof;
  prof.mark("start");
  float* sv = nullptr;
  kda_cuda_detail::Intermediates x;
  if (saved) {  // B1 done by the forward
    const Tensor s = workspace_buffer(buffers.saved, l.saved, kOp, "buffers.saved");
    sv = s.data<float>();
    x = kda_cuda_detail::saved_intermediates(pl, sv);
  } else {  // B1: the forward's kernels, storing what the backward needs
    sv = ws.data<float>();
    x = kda_cuda_detail::saved_intermediates(pl, sv);
    if (kept) {  // A_qk and M^-1 as the forward kept them
      const Tensor kb =
          workspace_buffer(buffers.kept, kda_cuda_detail::kept_floats(pl), kOp, "buffers.kept");
      x.aqk = kb.data<float>();
      x.minv = x.aqk + pl.NC * pl.HV * kC * kC;
      x.a_kept = true;
    }
    static_assert(sizeof(int32_t) == sizeof(float), "the chunk table shares the f32 workspace");
    device_copy(sv + l.meta, Device::cuda, pl.meta.data(), Device::cpu,
                pl.meta.size() * sizeof(int32_t));
    kda_cuda_detail::recompute(a, pl, x);
    prof.mark("recompute");
  }
  float* scratch = saved ? ws.data<float>() : sv + l.saved;

  if (a.q.dtype() == DType::bf16)
    run_bwd<__nv_bfloat16>(pl, a, d_o, d_final_state, x, scratch, l, g, prof);
  else
    run_bwd<float>(pl, a, d_o, d_final_state, x, scratch, l, g, prof);
  device_synchronize();
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "{}: kernels: {}", kOp, cudaGetErrorString(err));
  return g;
}

}  // namespace hlm::ops
