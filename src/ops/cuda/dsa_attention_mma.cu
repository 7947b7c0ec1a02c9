// The BF16 tensor-core forward and backward of the sparse / dense causal MLA attention
// (ops/cuda/dsa_attention_mma.cuh; dsa_attention.cu calls them for bf16 inputs and falls back to
// its FMA kernels where the shapes do not fit). The math is the FMA kernels': l_j = scale q[t,h] .
// kv[S_tj] over the keys of S_t in slot order, online softmax, out = sum_j p_j v_j / sum_j p_j,
// lse = m + log sum (empty row: out 0, lse -inf); the backward's p = exp(l - lse),
// ds = p (dout . v - Delta), dq = scale sum_j ds_j k_j, dkv[s] = sum over the (query, head) readers
// of s of scale ds q + (p dout ; 0). Only the rounding differs, as stated below.
//
// Forward. A block of 8 warps serves one query t and a group of HG = 16 MT heads (MT = 1, 2 or 4
// m tiles of 16 heads; 64 heads, the GLM-5.3 shape, in one block, so every key row is read once
// per query). The group's q rows [HG, D] stay in shared memory; the keys arrive in tiles of NK = 64
// rows (32 where shared memory is short: D = 576 at 64 heads), gathered with cp.async into two
// buffers (the next tile loads while this one is used; rows past the set are zero). Shared rows
// are D + 8 bf16 long: ldmatrix's 8 rows of 16 bytes then fall into different banks.
//   scores:  warp w owns m tile w % MT and the key slice w / MT (NK / (8 / MT) keys); S = q k^T by
//            mma.sync m16n8k16 (BF16 products, FP32 sums over D in k steps of 16), scaled and
//            masked (-inf past the set) into an FP32 tile [HG, NK] in shared memory.
//   softmax: 256 / HG consecutive threads per head row, NK HG / 256 keys each: the row max and
//            sum by butterflies; m' = max(m, max_j l_j), p_j = exp(l_j - m'), alpha = exp(m - m'),
//            sum = sum alpha + sum_j p_j (p in FP32); p rounded to BF16 into a [HG, NK] tile.
//   values:  warp w owns m tile w % MT and channel groups of 16 (d_v <= 512: at most 32 / (8 / MT)
//            groups per warp); acc = acc alpha + p V by mma (V = the key tile itself, read
//            transposed by ldmatrix.trans), in FP32 registers for the whole pass.
// At the end out = acc / sum (BF16), lse = m + log sum (FP32).
// Backward (after Delta = dout . out, dsa_attention.cu). Per query and head group, tile by tile:
// S = q k^T and dP = dout v^T by mma (the scores' warp layout), p and ds in FP32 registers, then
// dq += ds k (registers for the whole pass, D <= 576) and, for every entry (t, key j), its key-side
// contribution C = scale ds^T q + p^T dout over the group's heads ([keys, D] by mma with the heads
// as the k dimension, ds^T and p^T read transposed by ldmatrix.trans) into an FP32 workspace row
// per (entry, head group). The keys then gather their rows (gather_kernel: one block per key, its
// readers in increasing (t, slot) order, head groups in order, an FP32 sum), so dkv needs no
// atomics. The workspace holds a chunk of queries at a time (at most 2 GiB; a per-key cursor
// carries each key's place in its reader list from chunk to chunk).
// The indexer loss's target (target_kernel): per query, all heads (H <= 64) in one block, the
// forward's score tiles by mma from the attention's lse, the weights exp(l - lse) summed over the
// heads per key and normalised over the row; FP32 throughout after the BF16 products.
// Every sum runs in an order fixed by the shapes (the mma k steps, the tiles, the butterflies, the
// reader lists), so the results repeat bit for bit.
// Precision: the scores are exact BF16 products summed in FP32. The forward's p enters the value
// product rounded to BF16 (relative error <= 2^-9 per weight, the usual flash-attention trade;
// measured rel. L2 error of out 1.8e-3 against 1.55e-3 for the output's own rounding); the sum
// that divides it is FP32. The backward's p and ds enter their products as two BF16 parts
// (hi + lo, split_bf16): rounding to one part measured 2.3e-3 on dq and dkv, two parts leave only
// the outputs' own rounding (1.6e-3), at the cost of 3 of the 5 products done twice.
// Cost per key tile: forward 2 HG NK (D + d_v) FLOPs; backward 2 HG NK (3 D + 2 d_v), the last
// three products twice; shared memory holds q (and dout), two key tiles and the p (ds) tiles:
// 227 KiB forward at HG = 64, D = 512 (one block per SM). The workspace costs 8 D bytes of traffic
// per (entry, head group).
// What would make it faster: wgmma with the q tile and the p tile as register operands
// (FlashMLA's layout), a second query per block sharing the key tile loads, the scores' operands
// split over more warps so that each ldmatrix feeds more mma, and a key-tiled dkv pass over the
// readers shared by neighbouring keys in place of the workspace.
#include <cuda_bf16.h>

#include <algorithm>

#include <cstdint>
#include <cstdlib>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dsa_attention_mma.cuh"
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/mma_bf16.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDv = 512;  // d_v of the accumulators' register tiles

// Row strides: q and key rows D + 8 bf16, the f32 score tile NK + 4, the bf16 p tile NK + 8 (bf16
// rows of an odd number of 16-byte packs: conflict-free ldmatrix).
__host__ __device__ constexpr int row_stride(int D) {
  return D + 8;
}
__host__ __device__ constexpr int score_stride(int nk) {
  return nk + 4;
}
__host__ __device__ constexpr int p_stride(int nk) {
  return nk + 8;
}

// Shared memory of MT m tiles and key tiles of NK rows: q, two key tiles and p (bf16), the scores
// and the row state (f32).
inline size_t smem_bytes(int mt, int nk, int D) {
  const size_t hg = size_t(16 * mt), qs = size_t(row_stride(D));
  return 2 * (hg * qs + 2 * size_t(nk) * qs + hg * size_t(p_stride(nk))) +
         4 * (hg * size_t(score_stride(nk)) + 3 * hg);
}

// The shapes the kernel takes: D a multiple of 32 (two k steps per pass), d_v <= 512, 16-byte
// aligned rows (shared memory is the caller's check).
inline bool fits(int D, int dv, const void* q, const void* kv) {
  return D % 32 == 0 && D > 0 && dv <= kMaxDv && reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(kv) % 16 == 0;
}

// acc = 0 for every register tile.
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][2][4]) {
#pragma unroll
  for (int v = 0; v < N; ++v) zero(acc[v]);
}

// Rows [0, nrows) of dst (row stride ds, `cols` bf16 each, cols % 8 == 0) by cp.async from
// src(r) (16-byte aligned), zero where src(r) is null (the whole block; the caller commits).
template <class Src>
__device__ __forceinline__ void rows_async(nv_bf16* dst, int ds, int nrows, int cols, Src src) {
  const int cpr = cols / 8;
  for (int i = threadIdx.x; i < nrows * cpr; i += kThreads) {
    const int r = i / cpr, c = (i - r * cpr) * 8;
    const nv_bf16* from = src(r);
    if (from != nullptr)
      cp_async16(dst + r * ds + c, from + c);
    else
      *reinterpret_cast<uint4*>(dst + r * ds + c) = make_uint4(0, 0, 0, 0);
  }
}

// c[j] += A[r0 .. r0 + 16)[0 .. K) B[n0 + 8 j .. + 8)[0 .. K)^T for j < N: A and B row-major bf16
// in shared memory (strides as, bs), K % 32 == 0; one warp. The scores (q k^T) and dP (dout v^T).
template <int N>
__device__ __forceinline__ void abt_products(float (&c)[N][4], const nv_bf16* A, int as, int r0,
                                             const nv_bf16* B, int bs, int n0, int K) {
  const int lane = threadIdx.x & 31;
  const nv_bf16* arow = A + (r0 + (lane & 15)) * as + 8 * (lane >> 4);
  const nv_bf16* brow = B + (n0 + (lane & 7)) * bs + 8 * (lane >> 3);
  for (int k0 = 0; k0 < K; k0 += 32) {
    uint32_t a0[4], a1[4];
    ldmatrix_x4<false>(a0, arow + k0);
    ldmatrix_x4<false>(a1, arow + k0 + 16);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      uint32_t bb[4];
      ldmatrix_x4<false>(bb, brow + 8 * j * bs + k0);
      const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
      mma_bf16_16816(c[j], a0, b0);
      mma_bf16_16816(c[j], a1, b1);
    }
  }
}

// acc[v] += sum over the A parts (lo first) of A[r0 .. r0 + 16)[0 .. kend) B[0 .. kend)[16 cg ..
// 16 cg + 16) for the channel groups cg = cg0 + step v < ng: A row-major (stride as) or, with
// kTransA, the transpose of a row-major [k][m] array; B row-major [k][n] (stride bs), read
// transposed. kend % 16 == 0; one warp. The values (p v), dq (ds k) and the key contributions
// (ds^T q, p^T dout).
template <int V, int NA, bool kTransA>
__device__ __forceinline__ void ab_products(float (&acc)[V][2][4], const nv_bf16* const (&A)[NA],
                                            int as, int r0, const nv_bf16* B, int bs, int kend,
                                            int cg0, int step, int ng) {
  const int lane = threadIdx.x & 31;
  const int aoff = kTransA ? ((lane & 7) + 8 * (lane >> 4)) * as + r0 + 8 * ((lane >> 3) & 1)
                           : (r0 + (lane & 15)) * as + 8 * (lane >> 4);
  const nv_bf16* brow = B + ((lane & 7) + 8 * ((lane >> 3) & 1)) * bs + 8 * (lane >> 4);
  for (int kk = 0; kk < kend; kk += 16) {
    uint32_t a[NA][4];
#pragma unroll
    for (int u = 0; u < NA; ++u) ldmatrix_x4<kTransA>(a[u], A[u] + aoff + (kTransA ? kk * as : kk));
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int cg = cg0 + step * v;
      if (cg < ng) {
        uint32_t bb[4];
        ldmatrix_x4<true>(bb, brow + kk * bs + 16 * cg);
        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
        for (int u = NA - 1; u >= 0; --u) {
          mma_bf16_16816(acc[v][0], a[u], b0);
          mma_bf16_16816(acc[v][1], a[u], b1);
        }
      }
    }
  }
}

// The key tiles of a query's n keys in order: load(j0, b) issues the cp.async copies of rows
// j0 .. j0 + NK - 1 into buffer b (the caller's earlier copies, q's rows, join the first group);
// body(b, j0, nj) runs once tile j0 (nj rows) has landed for every thread, while the next tile
// loads into the other buffer. A barrier follows each body, so the next load may overwrite what
// it read. The whole block.
template <int NK, class Load, class Body>
__device__ __forceinline__ void for_each_tile(int64_t n, Load&& load, Body&& body) {
  const int64_t ntiles = (n + NK - 1) / NK;
  if (ntiles > 0) load(int64_t(0), 0);
  cp_async_commit();
  for (int64_t it = 0; it < ntiles; ++it) {
    const int b = int(it & 1);
    const int64_t j0 = it * NK;
    if (it + 1 < ntiles) load(j0 + NK, b ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    body(b, j0, int(n - j0 < NK ? n - j0 : NK));
    __syncthreads();
  }
  cp_async_wait<0>();
}

// The m tiles of 16 heads a block takes for H heads: 1, 2 or 4 (at most 64 heads per block).
inline int m_tiles(int H) {
  return H <= 16 ? 1 : H <= 32 ? 2 : 4;
}

// Key tiles of 64 rows, else 32, else 16: the first with at least 8 keys per score slice
// (16 mt nk >= 1024) whose shared memory bytes(nk) fits the device; 0 when none does.
template <class Bytes>
int key_tile(int mt, Bytes&& bytes) {
  const size_t optin = size_t(smem_optin());
  for (int c : {64, 32, 16})
    if (16 * mt * c >= 1024 && bytes(c) <= optin) return c;
  return 0;
}

// f(MT, NK) with compile-time values for the runtime mt (1, 2, 4) and nk (64, 32, 16).
template <class F>
void with_tiles(int mt, int nk, F&& f) {
  const auto by_nk = [&](auto mc) {
    if (nk == 64)
      f(mc, std::integral_constant<int, 64>{});
    else if (nk == 32)
      f(mc, std::integral_constant<int, 32>{});
    else
      f(mc, std::integral_constant<int, 16>{});
  };
  if (mt == 1)
    by_nk(std::integral_constant<int, 1>{});
  else if (mt == 2)
    by_nk(std::integral_constant<int, 2>{});
  else
    by_nk(std::integral_constant<int, 4>{});
}

template <int MT, int NK, class Keys>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_kernel(const nv_bf16* __restrict__ q, const nv_bf16* __restrict__ kv, Keys keys,
               nv_bf16* __restrict__ out, float* __restrict__ lse, int H, int D, int dv,
               float scale) {
  constexpr int HG = 16 * MT;
  constexpr int NW = kWarps / MT;  // warps per m tile
  constexpr int kN = NK, kSS = score_stride(NK), kPS = p_stride(NK);
  constexpr int SNT = kN / NW / 8;      // n8 tiles of a warp's score slice
  constexpr int VG = kMaxDv / 16 / NW;  // most channel groups of 16 per warp
  constexpr int TPR = kThreads / HG;    // softmax threads per head row
  constexpr int KPT = kN / TPR;         // keys per softmax thread
  static_assert(SNT >= 1 && KPT % 2 == 0, "8 keys per score slice, p stored in pairs");
  extern __shared__ float4 smem4[];
  const int QS = row_stride(D);
  nv_bf16* qs = reinterpret_cast<nv_bf16*>(smem4);
  nv_bf16* ks = qs + HG * QS;
  nv_bf16* ps = ks + 2 * kN * QS;
  float* ss = reinterpret_cast<float*>(ps + HG * kPS);
  float* mrow = ss + HG * kSS;
  float* lrow = mrow + HG;
  float* arow = lrow + HG;

  const int ngroups = (H + HG - 1) / HG;
  const int64_t t = blockIdx.x / ngroups;
  const int h0 = int(blockIdx.x % ngroups) * HG, hv = H - h0 < HG ? H - h0 : HG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t f = keys.first(t), n = keys.count(t);
  const nv_bf16* qt = q + (t * H + h0) * D;
  rows_async(qs, QS, HG, D, [&](int h) { return h < hv ? qt + h * D : nullptr; });
  if (tid < HG) mrow[tid] = -INFINITY, lrow[tid] = 0.f;
  // Rows j0 .. j0 + NK - 1 of S_t into key buffer b (zero past the set).
  const auto load_tile = [&](int64_t j0, int b) {
    rows_async(ks + b * kN * QS, QS, kN, D,
               [&](int j) { return j0 + j < n ? kv + keys.key_at(f, j0 + j) * D : nullptr; });
  };
  const int mi = warp % MT, wi = warp / MT, r0 = 16 * mi;
  const int nvg = (dv + 15) / 16;
  float acc[VG][2][4];
  zero(acc);

  for_each_tile<NK>(n, load_tile, [&](int b, int64_t, int nj) {
    const nv_bf16* kb = ks + b * kN * QS;

    // Scores of m tile mi, keys n0 .. n0 + 8 SNT.
    {
      const int n0 = wi * (kN / NW);
      float sacc[SNT][4];
      zero(sacc);
      abt_products(sacc, qs, QS, r0, kb, QS, n0, D);
#pragma unroll
      for (int j = 0; j < SNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + g + 8 * (e >> 1), col = n0 + 8 * j + 2 * tq + (e & 1);
          ss[row * kSS + col] = col < nj ? scale * sacc[j][e] : -INFINITY;
        }
    }
    __syncthreads();

    // Online softmax of each head row over the tile.
    {
      const int row = tid / TPR, part = tid % TPR;
      const float* sr = ss + row * kSS + part * KPT;
      const float mo = mrow[row];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < KPT; ++i) mx = fmaxf(mx, sr[i]);
#pragma unroll
      for (int o = TPR / 2; o >= 1; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float mn = fmaxf(mo, mx);
      float p[KPT], sum = 0.f;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        p[i] = mn == -INFINITY ? 0.f : expf(sr[i] - mn);
        sum += p[i];
      }
#pragma unroll
      for (int o = TPR / 2; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      uint32_t* pr = reinterpret_cast<uint32_t*>(ps + row * kPS + part * KPT);
#pragma unroll
      for (int i = 0; i < KPT; i += 2) pr[i / 2] = pack_bf16(p[i], p[i + 1]);
      if (part == 0) {
        const float a = mo == mn ? 1.f : expf(mo - mn);
        arow[row] = a;
        lrow[row] = lrow[row] * a + sum;
        mrow[row] = mn;
      }
    }
    __syncthreads();

    // acc = acc alpha + p V for m tile mi, channel groups wi VG ...
    if (dv > 0) {
      const float al0 = arow[r0 + g], al1 = arow[r0 + g + 8];
#pragma unroll
      for (int v = 0; v < VG; ++v)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[v][h][0] *= al0, acc[v][h][1] *= al0;
          acc[v][h][2] *= al1, acc[v][h][3] *= al1;
        }
      const nv_bf16* const pa[1] = {ps};
      ab_products<VG, 1, false>(acc, pa, kPS, r0, kb, QS, nj, wi * VG, 1, nvg);
    }
  });
  __syncthreads();  // the row state (no tiles: its initial values)

  if (out != nullptr) {
    const float l0 = lrow[r0 + g], l1 = lrow[r0 + g + 8];
#pragma unroll
    for (int v = 0; v < VG; ++v) {
      const int cg = wi * VG + v;
      if (cg >= nvg) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + g + 8 * (e >> 1), c = 16 * cg + 8 * h + 2 * tq + (e & 1);
          const float l = (e >> 1) ? l1 : l0;
          if (row < hv && c < dv)
            out[(t * H + h0 + row) * dv + c] = __float2bfloat16(l > 0.f ? acc[v][h][e] / l : 0.f);
        }
    }
  }
  if (tid < hv) lse[t * H + h0 + tid] = lrow[tid] > 0.f ? mrow[tid] + logf(lrow[tid]) : -INFINITY;
}

// ---- backward -----------------------------------------------------------------------------

// D_qk of the dq register tiles (GLM-5.3's absorbed 576).
constexpr int kMaxDq = 576;

__host__ __device__ constexpr int round32(int n) {
  return (n + 31) / 32 * 32;
}

// Shared memory of the backward: q [HG, D + 8], dout [HG, round32(d_v) + 8], two key tiles
// [NK, D + 8], p and ds as hi and lo parts [HG, NK + 8] each (bf16); lse and Delta [HG] (f32).
inline size_t bwd_smem_bytes(int mt, int nk, int D, int dv) {
  const size_t hg = size_t(16 * mt);
  return 2 * (hg * size_t(row_stride(D)) + hg * size_t(row_stride(round32(dv))) +
              2 * size_t(nk) * size_t(row_stride(D)) + 4 * hg * size_t(p_stride(nk))) +
         4 * 2 * hg;
}

// x ~ hi + lo, both bf16 (hi = bf16(x), lo = bf16(x - hi)): a product with a bf16 operand summed
// as lo b + hi b is within 2^-17 of x b, where hi b alone is within 2^-9.
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(x0, x1);
  lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// Per query t and head group G (of ngroups): p = exp(scale q k - lse), ds = p (dout . v - Delta)
// for every key of S_t, tile by tile; dq = scale sum_j ds_j k_j (registers, the whole pass); and
// each entry's key-side contribution of the group's heads, C[e, G] = scale sum_h ds_h q_h +
// sum_h p_h (dout_h ; 0), into the chunk's workspace (row (e - entry0(t0)) ngroups + G). p and ds
// enter the products split in two bf16 parts (split_bf16), so the backward keeps FP32-like
// weights. Warps: scores and dP as the forward's scores; dq as the forward's values (channel
// groups of 16 dealt round robin); C with 16-key m tiles and channel groups dealt round robin, two
// at a time.
template <int MT, int NK, class Keys>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_kernel(const nv_bf16* __restrict__ q, const nv_bf16* __restrict__ kv,
               const nv_bf16* __restrict__ dout, const float* __restrict__ lse,
               const float* __restrict__ delta, Keys keys, int64_t t0, float* __restrict__ contrib,
               nv_bf16* __restrict__ dq, int H, int D, int dv, float scale) {
  constexpr int HG = 16 * MT;
  constexpr int NW = kWarps / MT;
  constexpr int kN = NK, kPS = p_stride(NK);
  constexpr int SNT = kN / NW / 8;
  constexpr int QG = (kMaxDq / 16 + NW - 1) / NW;  // most dq channel groups per warp
  constexpr int KM = NK / 16;                      // key m tiles of C
  constexpr int WPK = kWarps / KM;                 // warps per key m tile
  static_assert(SNT >= 1 && WPK >= 1, "8 keys per score slice, 16 per C tile");
  extern __shared__ float4 smem4[];
  const int QS = row_stride(D), DVP = round32(dv), VS = row_stride(DVP);
  nv_bf16* qs = reinterpret_cast<nv_bf16*>(smem4);
  nv_bf16* dos = qs + HG * QS;
  nv_bf16* ks = dos + HG * VS;
  // p and ds, hi and lo parts: pd[0] = p hi, pd[1] = p lo, pd[2] = ds hi, pd[3] = ds lo.
  nv_bf16* const pd0 = ks + 2 * kN * QS;
  nv_bf16* const pd[4] = {pd0, pd0 + HG * kPS, pd0 + 2 * HG * kPS, pd0 + 3 * HG * kPS};
  float* lses = reinterpret_cast<float*>(pd0 + 4 * HG * kPS);
  float* dels = lses + HG;

  const int ngroups = (H + HG - 1) / HG;
  const int64_t t = t0 + blockIdx.x / ngroups;
  const int h0 = int(blockIdx.x % ngroups) * HG, hv = H - h0 < HG ? H - h0 : HG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t f = keys.first(t), n = keys.count(t);
  const int64_t erow = keys.entry0(t) - keys.entry0(t0);  // t's first entry of the workspace
  const int grp = int(blockIdx.x % ngroups);
  const int vpr = DVP / 8;
  const nv_bf16* qt = q + (t * H + h0) * D;
  rows_async(qs, QS, HG, D, [&](int h) { return h < hv ? qt + h * D : nullptr; });
  // dout rows zero-padded to DVP channels (dv need not be a multiple of 8: element loads there).
  for (int i = tid; i < HG * vpr; i += kThreads) {
    const int h = i / vpr, c = (i - h * vpr) * 8;
    nv_bf16* dst = dos + h * VS + c;
    if (h < hv && c + 8 <= dv && dv % 8 == 0) {
      cp_async16(dst, dout + ((t * H + h0 + h) * dv + c));
    } else {
      for (int u = 0; u < 8; ++u)
        dst[u] = h < hv && c + u < dv ? dout[(t * H + h0 + h) * dv + c + u] : __float2bfloat16(0.f);
    }
  }
  // Padded heads: lse = +inf makes p (and ds) 0.
  if (tid < HG) {
    lses[tid] = tid < hv ? lse[t * H + h0 + tid] : INFINITY;
    dels[tid] = tid < hv ? delta[t * H + h0 + tid] : 0.f;
  }
  const auto load_tile = [&](int64_t j0, int b) {
    rows_async(ks + b * kN * QS, QS, kN, D,
               [&](int j) { return j0 + j < n ? kv + keys.key_at(f, j0 + j) * D : nullptr; });
  };
  const int mi = warp % MT, wi = warp / MT, r0 = 16 * mi;
  const int ng = D / 16;  // channel groups of 16
  float acc[QG][2][4];
  zero(acc);

  for_each_tile<NK>(n, load_tile, [&](int b, int64_t j0, int nj) {
    const nv_bf16* kb = ks + b * kN * QS;

    // p and ds of m tile mi, keys n0 .. n0 + 8 SNT.
    {
      const int n0 = wi * (kN / NW);
      float sacc[SNT][4], pacc[SNT][4];
      zero(sacc);
      zero(pacc);
      abt_products(sacc, qs, QS, r0, kb, QS, n0, D);
      abt_products(pacc, dos, VS, r0, kb, QS, n0, DVP);
#pragma unroll
      for (int j = 0; j < SNT; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = r0 + g + 8 * hf, col = n0 + 8 * j + 2 * tq;
          float p[2], ds[2];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int e = 2 * hf + u;
            p[u] = col + u < nj ? expf(scale * sacc[j][e] - lses[row]) : 0.f;
            ds[u] = p[u] * (pacc[j][e] - dels[row]);
          }
          uint32_t* const w[4] = {reinterpret_cast<uint32_t*>(pd[0] + row * kPS + col),
                                  reinterpret_cast<uint32_t*>(pd[1] + row * kPS + col),
                                  reinterpret_cast<uint32_t*>(pd[2] + row * kPS + col),
                                  reinterpret_cast<uint32_t*>(pd[3] + row * kPS + col)};
          split_bf16(p[0], p[1], *w[0], *w[1]);
          split_bf16(ds[0], ds[1], *w[2], *w[3]);
        }
    }
    __syncthreads();

    // dq += ds k for m tile mi, channel groups wi, wi + NW, ...
    const nv_bf16* const ds_parts[2] = {pd[2], pd[3]};
    ab_products<QG, 2, false>(acc, ds_parts, kPS, r0, kb, QS, nj, wi, NW, ng);

    // C rows of this tile's keys: key m tile km, channel groups wj, wj + WPK, ... two at a time.
    {
      const int km = warp % KM, wj = warp / KM;
      // A = ds^T, p^T (keys x heads): transposed loads of the [head][key] tiles.
      const nv_bf16* const p_parts[2] = {pd[0], pd[1]};
      for (int cg0 = wj; cg0 < ng; cg0 += 2 * WPK) {
        float c[2][2][4];
        zero(c);
        ab_products<2, 2, true>(c, ds_parts, kPS, 16 * km, qs, QS, HG, cg0, WPK, ng);
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[u][h][e] *= scale;
        ab_products<2, 2, true>(c, p_parts, kPS, 16 * km, dos, VS, HG, cg0, WPK,
                                ng < DVP / 16 ? ng : DVP / 16);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int cg = cg0 + WPK * u;
          if (cg >= ng) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int key = 16 * km + g + 8 * hf, col = 16 * cg + 8 * h + 2 * tq;
              if (key < nj)
                *reinterpret_cast<float2*>(contrib + ((erow + j0 + key) * ngroups + grp) * D +
                                           col) = make_float2(c[u][h][2 * hf], c[u][h][2 * hf + 1]);
            }
        }
      }
    }
  });

#pragma unroll
  for (int v = 0; v < QG; ++v) {
    const int cg = wi + NW * v;
    if (cg >= ng) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + g + 8 * (e >> 1), c = 16 * cg + 8 * h + 2 * tq + (e & 1);
        if (row < hv) dq[(t * H + h0 + row) * D + c] = __float2bfloat16(scale * acc[v][h][e]);
      }
  }
}

// dkv (key side) of one chunk of queries [t0, t1): key s (a block) adds the workspace rows of its
// readers in the chunk (reader by reader, head group by head group) to its FP32 row sum;
// cursor[s] keeps where the next chunk starts (readers ascend in t). The last chunk writes dkv
// (bf16).
template <class Keys>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(Keys keys, int64_t t0, int64_t t1, const float* __restrict__ contrib,
                  int64_t* __restrict__ cursor, float* __restrict__ sum, nv_bf16* __restrict__ dkv,
                  int D, int ngroups) {
  constexpr int CPT = 3;  // channels per thread: D <= 768
  const int64_t s = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t ebase = keys.entry0(t0);
  const int64_t r0 = keys.readers_first(s), n = keys.readers_count(s);
  int64_t i = cursor[s];
  __syncthreads();  // every thread has read the cursor before thread 0 moves it
  float acc[CPT];
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const int c = tid + kThreads * k;
    acc[k] = c < D ? sum[s * D + c] : 0.f;
  }
  for (; i < n && keys.reader_at(r0, i) < t1; ++i)
    for (int G = 0; G < ngroups; ++G) {
      const float* row = contrib + ((keys.reader_entry(s, r0, i) - ebase) * ngroups + G) * D;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int c = tid + kThreads * k;
        if (c < D) acc[k] += row[c];
      }
    }
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const int c = tid + kThreads * k;
    if (c >= D) continue;
    if (dkv != nullptr)
      dkv[s * D + c] = __float2bfloat16(acc[k]);
    else
      sum[s * D + c] = acc[k];
  }
  if (tid == 0) cursor[s] = i;
}

template <class Keys>
bool launch_bwd(const nv_bf16* q, const nv_bf16* kv, const nv_bf16* dout, const float* lse,
                const float* delta, const Keys& keys, int64_t nkeys, int64_t max_keys, nv_bf16* dq,
                nv_bf16* dkv, int64_t T, int H, int D, int dv, double scale, const char* what) {
  if (!fits(D, dv, q, kv) || D > kMaxDq || reinterpret_cast<uintptr_t>(dout) % 16 != 0)
    return false;
  const int mt = m_tiles(H);
  // 16-row key tiles need 64 heads a block, 32 rows 32 heads.
  const int nk = key_tile(mt, [&](int c) { return bwd_smem_bytes(mt, c, D, dv); });
  if (nk == 0) return false;
  const int ngroups = (H + 16 * mt - 1) / (16 * mt);
  // Chunks of queries whose workspace rows (at most max_keys per query and head group) fit 2 GiB
  // (HLM_DSA_ATTN_WORKSPACE, bytes, lowers the bound: the tests' many chunks on small shapes).
  const int64_t rows_per_query = std::max<int64_t>(max_keys, 1) * ngroups;
  const int64_t per_query = rows_per_query * D * int64_t(sizeof(float));
  int64_t budget = int64_t(1) << 31;
  if (const char* e = std::getenv("HLM_DSA_ATTN_WORKSPACE")) {
    const long long v = std::atoll(e);
    if (v > 0 && v < budget) budget = v;
  }
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(T, budget / per_query));
  const Tensor contrib = alloc({chunk * rows_per_query, D}, DType::f32);
  Tensor cursor = alloc({nkeys}, DType::i64), sum = alloc({nkeys, D}, DType::f32);
  cursor.zero_();
  sum.zero_();
  const size_t smem = bwd_smem_bytes(mt, nk, D, dv);
  const auto go = [&](auto mc, auto nc) {
    constexpr int MT = decltype(mc)::value, NK = decltype(nc)::value;
    if constexpr (16 * MT * NK >= 1024) {
      const auto kernel = &bwd_kernel<MT, NK, Keys>;
      set_smem(reinterpret_cast<const void*>(kernel), smem, what);
      for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t t1 = std::min(T, t0 + chunk);
        const int64_t blocks = (t1 - t0) * ngroups;
        HLM_CHECK(blocks < (int64_t(1) << 31), "{}: {} blocks exceed the grid limit", what, blocks);
        kernel<<<unsigned(blocks), kThreads, smem>>>(
            q, kv, dout, lse, delta, keys, t0, mptr<float>(contrib), dq, H, D, dv, float(scale));
        check_launch(what);
        // Keys past the chunk's last query (global token q0 + t1 - 1) have no reader yet
        // (causal); the last chunk writes every key.
        const bool last = t1 == T;
        const int64_t nk_launch = last ? nkeys : std::min(nkeys, keys.q0 + t1);
        if (nk_launch == 0) continue;
        gather_kernel<Keys><<<unsigned(nk_launch), kThreads>>>(
            keys, t0, t1, cptr<float>(contrib), mptr<int64_t>(cursor), mptr<float>(sum),
            last ? dkv : nullptr, D, ngroups);
        check_launch(what);
      }
    }
  };
  with_tiles(mt, nk, go);
  return true;
}

template <class Keys>
bool launch(const nv_bf16* q, const nv_bf16* kv, const Keys& keys, nv_bf16* out, float* lse,
            int64_t T, int H, int D, int dv, double scale, const char* what) {
  if (!fits(D, dv, q, kv)) return false;
  const int mt = m_tiles(H);
  const int nk = key_tile(mt, [&](int c) { return smem_bytes(mt, c, D); });
  if (nk == 0) return false;
  if (T == 0 || H == 0) return true;
  const int64_t blocks = T * ((H + 16 * mt - 1) / (16 * mt));
  HLM_CHECK(blocks < (int64_t(1) << 31), "{}: {} blocks exceed the grid limit", what, blocks);
  const size_t smem = smem_bytes(mt, nk, D);
  const auto go = [&](auto mc, auto nc) {
    constexpr int MT = decltype(mc)::value, NK = decltype(nc)::value;
    if constexpr (16 * MT * NK >= 1024) {
      const auto kernel = &fwd_kernel<MT, NK, Keys>;
      set_smem(reinterpret_cast<const void*>(kernel), smem, what);
      kernel<<<unsigned(blocks), kThreads, smem>>>(q, kv, keys, out, lse, H, D, dv, float(scale));
      check_launch(what);
    }
  };
  with_tiles(mt, nk, go);
  return true;
}

// ---- the indexer loss's target --------------------------------------------------------------

// Shared memory of the target kernel: q and two key tiles (bf16), the score tile, the heads' lse,
// the per-key partial sums [kThreads / NK][NK] and the warps' partial totals (f32).
inline size_t target_smem_bytes(int mt, int nk, int D) {
  const size_t hg = size_t(16 * mt), qs = size_t(row_stride(D));
  return 2 * (hg * qs + 2 * size_t(nk) * qs) +
         4 * (hg * size_t(score_stride(nk)) + hg + size_t(kThreads) + size_t(kWarps));
}

// p*[t, slot of key j] = sum_h exp(scale q_h . k_j - lse_h) / (the same summed over the row's keys)
// for one query t per block, all H <= 64 heads in the block (16 MT rows, the padding heads with
// lse = +inf add 0): the forward's score tiles by mma (the same products as its lse), then per key
// the sum over heads in head order (kThreads / NK threads per key, each a run of consecutive
// heads, then their partial sums in order), written unnormalised; at the end the row's total over
// its keys (each thread a fixed stride of keys, then the warps in order) and every entry divided
// by it. Entries outside the set stay 0.
template <int MT, int NK, class Keys>
__global__ void __launch_bounds__(kThreads, 1)
    target_kernel(const nv_bf16* __restrict__ q, const nv_bf16* __restrict__ kv, Keys keys,
                  const float* __restrict__ lse, float* __restrict__ out, int H, int D, int64_t W,
                  float scale) {
  constexpr int HG = 16 * MT;
  constexpr int NW = kWarps / MT;
  constexpr int kN = NK, kSS = score_stride(NK);
  constexpr int SNT = kN / NW / 8;
  constexpr int PARTS = kThreads / kN, HPP = HG / PARTS;  // threads per key, heads per thread
  static_assert(SNT >= 1 && HPP >= 1 && HG % PARTS == 0, "tile shapes");
  extern __shared__ float4 smem4[];
  const int QS = row_stride(D);
  nv_bf16* qs = reinterpret_cast<nv_bf16*>(smem4);
  nv_bf16* ks = qs + HG * QS;
  float* ss = reinterpret_cast<float*>(ks + 2 * kN * QS);
  float* lrow = ss + HG * kSS;
  float* part = lrow + HG;
  float* red = part + kThreads;

  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t f = keys.first(t), n = keys.count(t);
  float* orow = out + t * W;
  for (int64_t j = tid; j < W; j += kThreads) orow[j] = 0.f;
  rows_async(qs, QS, HG, D, [&](int h) { return h < H ? q + (t * H + h) * D : nullptr; });
  if (tid < HG) lrow[tid] = tid < H ? lse[t * H + tid] : INFINITY;
  const auto load_tile = [&](int64_t j0, int b) {
    rows_async(ks + b * kN * QS, QS, kN, D,
               [&](int j) { return j0 + j < n ? kv + keys.key_at(f, j0 + j) * D : nullptr; });
  };
  const int mi = warp % MT, wi = warp / MT, r0 = 16 * mi;
  for_each_tile<NK>(n, load_tile, [&](int b, int64_t j0, int nj) {
    const nv_bf16* kb = ks + b * kN * QS;
    {
      const int n0 = wi * (kN / NW);
      float sacc[SNT][4];
      zero(sacc);
      abt_products(sacc, qs, QS, r0, kb, QS, n0, D);
#pragma unroll
      for (int j = 0; j < SNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + g + 8 * (e >> 1), col = n0 + 8 * j + 2 * tq + (e & 1);
          ss[row * kSS + col] = scale * sacc[j][e];
        }
    }
    __syncthreads();
    {
      const int c = tid % kN, pp = tid / kN;
      float s = 0.f;
#pragma unroll 4
      for (int h = pp * HPP; h < (pp + 1) * HPP; ++h) s += expf(ss[h * kSS + c] - lrow[h]);
      part[pp * kN + c] = s;
    }
    __syncthreads();
    if (tid < nj) {
      float v = 0.f;
#pragma unroll
      for (int pp = 0; pp < PARTS; ++pp) v += part[pp * kN + tid];
      orow[keys.slot_at(f, j0 + tid)] = v;
    }
  });
  __syncthreads();
  float tot = 0.f;
  for (int64_t j = tid; j < n; j += kThreads) tot += orow[keys.slot_at(f, j)];
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) tot += __shfl_xor_sync(0xffffffffu, tot, o);
  if (lane == 0) red[warp] = tot;
  __syncthreads();
  tot = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tot += red[w];
  for (int64_t j = tid; j < n; j += kThreads) {
    const int64_t sl = keys.slot_at(f, j);
    orow[sl] = orow[sl] / tot;
  }
}

template <class Keys>
bool launch_target(const nv_bf16* q, const nv_bf16* kv, const Keys& keys, const float* lse,
                   float* out, int64_t T, int H, int D, int64_t W, double scale, const char* what) {
  if (H > 64 || !fits(D, 0, q, kv)) return false;
  const int mt = m_tiles(H);
  const int nk = key_tile(mt, [&](int c) { return target_smem_bytes(mt, c, D); });
  if (nk == 0) return false;
  if (T == 0 || H == 0 || W == 0) return true;
  HLM_CHECK(T < (int64_t(1) << 31), "{}: T = {} exceeds the grid limit", what, T);
  const size_t smem = target_smem_bytes(mt, nk, D);
  const auto go = [&](auto mc, auto nc) {
    constexpr int MT = decltype(mc)::value, NK = decltype(nc)::value;
    if constexpr (16 * MT * NK >= 1024) {
      const auto kernel = &target_kernel<MT, NK, Keys>;
      set_smem(reinterpret_cast<const void*>(kernel), smem, what);
      kernel<<<unsigned(T), kThreads, smem>>>(q, kv, keys, lse, out, H, D, W, float(scale));
      check_launch(what);
    }
  };
  with_tiles(mt, nk, go);
  return true;
}

}  // namespace

bool attention_target_mma(const nv_bf16* q, const nv_bf16* kv, const PatternKeys& keys,
                          const float* lse, float* out, int64_t T, int H, int D, int64_t W,
                          double scale, const char* what) {
  return launch_target(q, kv, keys, lse, out, T, H, D, W, scale, what);
}
bool attention_target_mma(const nv_bf16* q, const nv_bf16* kv, const DenseKeys& keys,
                          const float* lse, float* out, int64_t T, int H, int D, int64_t W,
                          double scale, const char* what) {
  return launch_target(q, kv, keys, lse, out, T, H, D, W, scale, what);
}

bool attention_fwd_mma(const nv_bf16* q, const nv_bf16* kv, const PatternKeys& keys, nv_bf16* out,
                       float* lse, int64_t T, int H, int D, int dv, double scale,
                       const char* what) {
  return launch(q, kv, keys, out, lse, T, H, D, dv, scale, what);
}
bool attention_fwd_mma(const nv_bf16* q, const nv_bf16* kv, const DenseKeys& keys, nv_bf16* out,
                       float* lse, int64_t T, int H, int D, int dv, double scale,
                       const char* what) {
  return launch(q, kv, keys, out, lse, T, H, D, dv, scale, what);
}

bool attention_bwd_mma(const nv_bf16* q, const nv_bf16* kv, const nv_bf16* dout, const float* lse,
                       const float* delta, const PatternKeys& keys, int64_t nkeys, int64_t max_keys,
                       nv_bf16* dq, nv_bf16* dkv, int64_t T, int H, int D, int dv, double scale,
                       const char* what) {
  return launch_bwd(q, kv, dout, lse, delta, keys, nkeys, max_keys, dq, dkv, T, H, D, dv, scale,
                    what);
}
bool attention_bwd_mma(const nv_bf16* q, const nv_bf16* kv, const nv_bf16* dout, const float* lse,
                       const float* delta, const DenseKeys& keys, int64_t nkeys, int64_t max_keys,
                       nv_bf16* dq, nv_bf16* dkv, int64_t T, int H, int D, int dv, double scale,
                       const char* what) {
  return launch_bwd(q, kv, dout, lse, delta, keys, nkeys, max_keys, dq, dkv, T, H, D, dv, scale,
                    what);
}

}  // namespace hlm::ops::cuda
