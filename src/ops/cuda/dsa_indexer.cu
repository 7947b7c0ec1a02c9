// The DSA lightning-indexer scoring on CUDA (ops/cuda/dsa_indexer.cuh), the math of
// ops/cpu/dsa_indexer.cpp:
//   z[t,h,s] = scale * q[t,h] . k[s],   I(t, s) = sum_h w[t,h] ReLU(z[t,h,s])   (ReLU optional)
//   dz[t,h,s] = d[t,s] w[t,h] scale ReLU'(z)
//   dq[t,h] = sum_s dz k[s],   dw[t,h] = sum_s d[t,s] ReLU(z),   dk[s] = sum_{t,h} dz q[t,h]
// over the keys s visible to t (dense layout: the document's first (r + 1) / P keys, column j =
// key key_base[t] + j; explicit rows: the pattern's entries). d_scores outside the set are never
// read. Arithmetic in f32 (f64 for f64), scores and d_scores in that dtype; q, k, w, dq, dk, dw in
// the input dtype (f32, f64, bf16).
//
// FP8 emulation (opt.fp8): a pre-pass (fp8_emulate_kernel, one warp per 128-channel block of a q
// or k row) writes the dequantised q and k in the computation dtype with the f32 steps of the CPU's
// fp8_emulate (amax, floor, fp8_scale_inv, x / s, e4m3 satfinite by cuda_fp8.h's conversion, code
// value * s), so both sides score the same values; the kernels then read those copies (TQ = A).
// Backward is straight-through: the same copies stand in for q and k. A non-finite q or k sets a
// device flag; the launcher reads it back after queueing the scoring kernels and throws the CPU's
// error (one 4-byte synchronous copy per call, in the FP8 emulation only).
//
// Work split. Every kernel that multiplies tiles uses one engine: a block of TM * 4 threads (TM =
// 64 rows: 256 threads; or TM = 32) computes a TM x 64 tile of dot products S[i][j] = a_i . b_j,
// staging 32 channels of the TM "row" vectors and the 64 "column" vectors per step in shared
// memory (channel-major, so a thread reads its 4 rows and 4 columns as two 16-byte loads) and
// keeping a 4 x 4 block of S per thread in registers; channels run in order, so each S entry is
// one fixed-order FMA chain. The row / column vectors are given as element offsets (-1: a zero
// vector), so the same engine serves queries x keys, keys x queries and heads x gathered keys.
// Gradients use a second step, acc[TM x 128] += dS[TM x 64] C[64 x 128], with C the column-side
// vectors' 128-channel part (a block owns one part; parts = ceil(d_I / 128), 1 for d_I = 128) and
// 4 x 8 accumulators per thread.
//   dense_fwd:  block = 64 queries x 64 columns; heads in order, S then acc += w ReLU(scale S).
//               A query tile that straddles documents is run once per document segment (rows of
//               other segments are masked); tiles beyond every visible key only write -inf.
//   dense_dq:   block = 64 queries x one head x one 128-channel part of dq; loops over the key
//               tiles of each segment in order: S, dS (masked), dw partial (4 columns in order,
//               then an xor butterfly over the 16 threads of the row group), dq += dS K.
//   dense_dk:   block = 64 keys x one part x one group of heads; gathers over its readers (the
//               later queries of the key's document, from the first query that sees it) in
//               query-tile order, the group's heads in order inside a tile: S^T = K Q_h^T, dS^T,
//               dk += dS^T Q_h. The heads are split into groups (a number fixed by the shapes) so
//               that the grid fills the GPU; the groups' partial sums [groups, nkeys, d_I] are then
//               added in group order (dense_dk_reduce). No atomics.
//   rows_fwd:   block = one query; rows = its heads (TM = 32 when H <= 32), columns = 64 pattern
//               entries at a time (keys gathered by offset); head sums reduced across the row
//               groups through shared memory in a fixed order.
//   rows_dq:    block = one query x one part; as dense_dq with heads as rows and the query's
//               entries (slot order) as columns.
//   rows_dk:    block = one key, 8 warps; its readers from the inverse map (increasing (t, slot)),
//               8 at a time, one per warp: z for every head (lanes over channels, warp butterfly),
//               g = sum_h dz q[t,h] (for d_I <= 128 with q[t,h] and g in registers, q read once)
//               into shared memory, then added to dk in reader order.
// The backward kernels issue the next channel chunk's global loads before the current chunk's
// products (tile_dot<PF = true>); the forward kernels keep their registers low for occupancy.
// Every sum has a fixed order that depends on the shapes only, so results repeat bit for bit.
// Measured on an H100 (bf16, H_I = 32, d_I = 128, one document of T = 8192): dense_fwd 13.7 ms
// (20 TFLOP/s of f32 FMA), dense_dq 31 ms, dense_dk 35 ms; with P = 4: 3.7, 7.8, 9.4 ms. Explicit
// rows, 2048 keys per query: rows_fwd 6.4 ms, rows_dq 15.5 ms, rows_dk 46 ms, all well below the
// host's work of checking the rows and building and uploading the pattern (ops/dsa_common.h:
// about 1 s single-threaded; 287 ms on 16 cores for the 12.6 M entries of a top-2048 KPool
// selection at T = 8192, bench/RESULTS.md).
// Faster paths not taken here: 3xTF32 mma.sync for the two tile products (TF32 alone misses the f32
// tolerance), 8 x 8 register blocks, keeping a key tile resident across heads, a dz workspace (or
// bf16 q copies) for rows_dk, which re-reads q[t] for every (key, reader) pair and is memory bound.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_indexer.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kTile = 64;   // columns of a tile (and rows of a 64-row tile)
constexpr int kKc = 32;     // channels staged per step of the dot engine
constexpr int kPart = 128;  // gradient channels per block
constexpr int kLdB = kTile + 4;
constexpr int kLdC = kPart + 4;
constexpr int kDkWarps = 8;
constexpr int64_t kDkTargetBlocks = 1024;  // dense_dk grid size to aim for (shapes only)

// ---- small device helpers ----

template <class A>
__device__ __forceinline__ void ld4(const A* p, A (&v)[4]) {
  if constexpr (std::is_same_v<A, float>) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    const double2 x = *reinterpret_cast<const double2*>(p);
    const double2 y = *reinterpret_cast<const double2*>(p + 2);
    v[0] = x.x, v[1] = x.y, v[2] = y.x, v[3] = y.y;
  }
}

template <class A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// Sum over the 16 threads of a row group (threads 16g .. 16g + 15 of a warp): fixed butterfly.
template <class A>
__device__ __forceinline__ A group16_sum(A v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- FP8 emulation ----

__device__ __forceinline__ bool finite_f32(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The value of an E4M3 code (never NaN here: satfinite conversions of finite values).
__device__ __forceinline__ float e4m3_value(unsigned code) {
  const unsigned e = (code >> 3) & 15u, m = code & 7u;
  const float v = e == 0 ? float(m) * 0x1p-9f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (code & 0x80u) ? -v : v;
}

// fp8_scale_inv (ops/fp8_quant.cpp) for E4M3: amax_g / 448, or the power of two at or above it.
__device__ __forceinline__ float e4m3_scale_inv(float amax, bool pow2) {
  const float r = fmaxf(amax, 1e-12f) / 448.0f;
  if (!pow2) return r;
  const unsigned b = __float_as_uint(r);  // a positive normal float
  return (b & 0x7fffffu) == 0 ? r : __uint_as_float(((b >> 23) + 1u) << 23);
}

// One warp per (row, 128-channel block): out = dequantised x (see IndexerScoreOptions::fp8).
template <class T, class A>
__global__ void __launch_bounds__(256)
    fp8_emulate_kernel(const T* __restrict__ x, A* __restrict__ out, int64_t rows, int D, int nb,
                       float amax_floor, bool pow2, int* __restrict__ bad) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= rows * nb) return;  // whole warps
  const int64_t row = gw / nb;
  const int c0 = int(gw % nb) * 128, c1 = std::min(D, c0 + 128);
  float f[4];
  float amax = 0.0f;
  bool fin = true;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int c = c0 + lane + 32 * m;
    f[m] = c < c1 ? float(ld<acc_t<T>>(x, row * D + c)) : 0.0f;
    fin = fin && finite_f32(f[m]);
    amax = fmaxf(amax, fabsf(f[m]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!fin) *bad = 1;  // every writer writes the same value
  const float s = e4m3_scale_inv(fmaxf(amax, amax_floor), pow2);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int c = c0 + lane + 32 * m;
    if (c < c1) {
      const __nv_fp8_storage_t code = __nv_cvt_float_to_fp8(f[m] / s, __NV_SATFINITE, __NV_E4M3);
      out[row * D + c] = A(e4m3_value(unsigned(code)) * s);
    }
  }
}

// ---- the tile engine ----

// Shared-memory layout of a TM-row tile (in elements of A, from the 16-byte aligned dynamic
// shared memory): the dot engine's two chunks (As [kKc][TM + 4], Bs [kKc][kLdB]) share room with
// the gradient step's C part (Cp [kTile][kLdC]); dS [TM][kLdB] follows.
template <int TM>
struct TileSmem {
  static constexpr int kThreads = TM * 4;
  static constexpr int kLdA = TM + 4;
  static constexpr int kDot = kKc * (kLdA + kLdB);
  static constexpr int kRegion = kDot > kTile* kLdC ? kDot : kTile* kLdC;
  static constexpr int kFwd = kDot;
  static constexpr int kBwd = kRegion + TM * kLdB;
};

// s[ii][jj] = sum_c a[a_off[ty*4+ii] + c] * b[b_off[tx*4+jj] + c] over c < D, in channel order.
// a_off [TM], b_off [kTile]: element offsets, -1 for a zero vector. With PF the next chunk's
// global loads are issued into registers before the current chunk's products, so their latency
// overlaps the arithmetic (at the price of registers: used by the backward kernels, whose
// occupancy is bounded by their accumulators anyway; the forward kernels rely on occupancy).
// Ends with a barrier (As and Bs free again).
template <int TM, bool PF, class A, class TQ>
__device__ __forceinline__ void tile_dot(const TQ* __restrict__ a, const int64_t* a_off,
                                         const TQ* __restrict__ b, const int64_t* b_off, int D,
                                         A* As, A* Bs, A (&s)[4][4]) {
  constexpr int NT = TileSmem<TM>::kThreads, LA = TileSmem<TM>::kLdA;
  constexpr int NA = TM * kKc / NT, NB = kTile * kKc / NT;  // staged elements per thread
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = A(0);
  // Element m of this thread: row (tid + m NT) / kKc, channel (tid + m NT) % kKc of the chunk.
  auto load_a = [&](int c0, int m) {
    const int e = tid + m * NT, r = e / kKc, c = e % kKc;
    const int64_t o = a_off[r];
    return (o >= 0 && c0 + c < D) ? ld<A>(a, o + c0 + c) : A(0);
  };
  auto load_b = [&](int c0, int m) {
    const int e = tid + m * NT, r = e / kKc, c = e % kKc;
    const int64_t o = b_off[r];
    return (o >= 0 && c0 + c < D) ? ld<A>(b, o + c0 + c) : A(0);
  };
  auto put_a = [&](int m, A v) {
    const int e = tid + m * NT;
    As[(e % kKc) * LA + e / kKc] = v;
  };
  auto put_b = [&](int m, A v) {
    const int e = tid + m * NT;
    Bs[(e % kKc) * kLdB + e / kKc] = v;
  };
  [[maybe_unused]] A ra[PF ? NA : 1], rb[PF ? NB : 1];
  if constexpr (PF) {
    if (D > 0) {
#pragma unroll
      for (int m = 0; m < NA; ++m) ra[m] = load_a(0, m);
#pragma unroll
      for (int m = 0; m < NB; ++m) rb[m] = load_b(0, m);
    }
  }
  for (int c0 = 0; c0 < D; c0 += kKc) {
    if constexpr (PF) {
#pragma unroll
      for (int m = 0; m < NA; ++m) put_a(m, ra[m]);
#pragma unroll
      for (int m = 0; m < NB; ++m) put_b(m, rb[m]);
    } else {
#pragma unroll 1
      for (int m = 0; m < NA; ++m) put_a(m, load_a(c0, m));
#pragma unroll 1
      for (int m = 0; m < NB; ++m) put_b(m, load_b(c0, m));
    }
    __syncthreads();
    if constexpr (PF) {
      if (c0 + kKc < D) {
#pragma unroll
        for (int m = 0; m < NA; ++m) ra[m] = load_a(c0 + kKc, m);
#pragma unroll
        for (int m = 0; m < NB; ++m) rb[m] = load_b(c0 + kKc, m);
      }
    }
#pragma unroll 4
    for (int c = 0; c < kKc; ++c) {
      A av[4], bv[4];
      ld4(As + c * LA + ty * 4, av);
      ld4(Bs + c * kLdB + tx * 4, bv);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = dfma(av[i], bv[j], s[i][j]);
    }
    __syncthreads();
  }
}

// The channel of accumulator column cc (0..7) of thread column group tx in a 128-channel part.
__device__ __forceinline__ int part_col(int tx, int cc) {
  return (cc < 4 ? 0 : kTile) + tx * 4 + (cc & 3);
}

// acc[ii][cc] += sum_j dS[ty*4+ii][j] * src[c_off[j] + c_begin + part_col(tx, cc)] (j in order).
// dS [TM][kLdB] written by the caller since the last barrier; Cp may alias the dot engine's
// chunks. Ends with a barrier.
template <int TM, class A, class TQ>
__device__ __forceinline__ void tile_product(const TQ* __restrict__ src, const int64_t* c_off,
                                             int c_begin, int D, const A* dS, A* Cp,
                                             A (&acc)[4][8]) {
  constexpr int NT = TileSmem<TM>::kThreads;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  for (int e = tid; e < kTile * kPart; e += NT) {
    const int j = e / kPart, c = e % kPart;
    const int64_t o = c_off[j];
    Cp[j * kLdC + c] = (o >= 0 && c_begin + c < D) ? ld<A>(src, o + c_begin + c) : A(0);
  }
  __syncthreads();
  for (int j0 = 0; j0 < kTile; j0 += 4) {
    A d[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) ld4(dS + (ty * 4 + i) * kLdB + j0, d[i]);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      A b0[4], b1[4];
      ld4(Cp + (j0 + jj) * kLdC + tx * 4, b0);
      ld4(Cp + (j0 + jj) * kLdC + kTile + tx * 4, b1);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[i][c] = dfma(d[i][jj], b0[c], acc[i][c]);
          acc[i][4 + c] = dfma(d[i][jj], b1[c], acc[i][4 + c]);
        }
    }
  }
  __syncthreads();
}

// The score gradient of one entry: dz = g w scale ReLU'(z) (returned), dw += g ReLU(z).
template <class A>
__device__ __forceinline__ A entry_grad(bool valid, A g, A wv, A z, A scale, bool relu, A& dwp) {
  const bool on = !relu || z > A(0);
  if (valid) dwp += g * (on ? z : A(0));
  return valid && on ? g * wv * scale : A(0);
}

// Document segments of a 64-query tile: [a, b) of rows with the same doc_start (ds[]: per row,
// -1 past the end). Every thread walks them in the same order.
__device__ __forceinline__ int segment_end(const int64_t* ds, int a, int n) {
  int b = a + 1;
  while (b < n && ds[b] == ds[a]) ++b;
  return b;
}

// ---- dense (causal) layout ----

template <class TQ, class T, class A>
__global__ void __launch_bounds__(256)
    dense_fwd_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                     const int64_t* __restrict__ doc_start, const int64_t* __restrict__ key_base,
                     A* __restrict__ out, int64_t T_, int H, int D, int64_t W, int64_t P, A scale,
                     bool relu) {
  using S = TileSmem<kTile>;
  extern __shared__ float4 smem4[];
  A* As = reinterpret_cast<A*>(smem4);
  A* Bs = As + kKc * S::kLdA;
  __shared__ int64_t s_ds[kTile], s_kb[kTile], s_roff[kTile], s_coff[kTile];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t t0 = int64_t(blockIdx.y) * kTile, j0 = int64_t(blockIdx.x) * kTile;
  const int nq = int(std::min<int64_t>(kTile, T_ - t0));
  if (tid < kTile) {
    const bool v = tid < nq;
    s_ds[tid] = v ? doc_start[t0 + tid] : -1;
    s_kb[tid] = v ? key_base[t0 + tid] : 0;
    s_roff[tid] = v ? (t0 + tid) * H * D : -1;
  }
  __syncthreads();
  for (int a = 0; a < nq;) {
    const int b = segment_end(s_ds, a, nq);
    const int64_t ds = s_ds[a], kb = s_kb[a];
    const int64_t n_max = (t0 + b - ds) / P;  // keys of the segment's last query
    A acc[4][4] = {};
    if (j0 < n_max) {
      if (tid < kTile) s_coff[tid] = j0 + tid < n_max ? (kb + j0 + tid) * D : -1;
      __syncthreads();
      for (int h = 0; h < H; ++h) {
        A s[4][4];
        tile_dot<kTile, false>(q + int64_t(h) * D, s_roff, k, s_coff, D, As, Bs, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = ty * 4 + i;
          const A wv = r < nq ? ld<A>(w, (t0 + r) * H + h) : A(0);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            A z = scale * s[i][j];
            if (relu) z = z > A(0) ? z : A(0);
            acc[i][j] = dfma(wv, z, acc[i][j]);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty * 4 + i;
      if (r < a || r >= b) continue;
      const int64_t t = t0 + r, n_t = (t - ds + 1) / P;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t col = j0 + tx * 4 + j;
        if (col < W) out[t * W + col] = col < n_t ? acc[i][j] : neg_inf<A>();
      }
    }
    a = b;
  }
}

// dq [T, H, D] (one 128-channel part per blockIdx.z) and dw [T, H] (part 0).
template <class TQ, class T, class A>
__global__ void __launch_bounds__(256, 2)
    dense_dq_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                    const A* __restrict__ dsc, const int64_t* __restrict__ doc_start,
                    const int64_t* __restrict__ key_base, T* __restrict__ dq, T* __restrict__ dw,
                    int64_t T_, int H, int D, int64_t W, int64_t P, A scale, bool relu) {
  using S = TileSmem<kTile>;
  extern __shared__ float4 smem4[];
  A* As = reinterpret_cast<A*>(smem4);
  A* Bs = As + kKc * S::kLdA;
  A* Cp = As;
  A* dS = As + S::kRegion;
  __shared__ int64_t s_ds[kTile], s_kb[kTile], s_roff[kTile], s_coff[kTile];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  // The last query tiles see the most keys: they start first.
  const int64_t t0 = int64_t(gridDim.x - 1 - blockIdx.x) * kTile;
  const int h = blockIdx.y, c_begin = int(blockIdx.z) * kPart;
  const int nq = int(std::min<int64_t>(kTile, T_ - t0));
  if (tid < kTile) {
    const bool v = tid < nq;
    s_ds[tid] = v ? doc_start[t0 + tid] : -1;
    s_kb[tid] = v ? key_base[t0 + tid] : 0;
    s_roff[tid] = v ? (t0 + tid) * H * D : -1;
  }
  __syncthreads();
  const TQ* qh = q + int64_t(h) * D;
  A acc[4][8] = {};
  A dwacc[4] = {};
  A wv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    wv[i] = r < nq ? ld<A>(w, (t0 + r) * H + h) : A(0);
  }
  for (int a = 0; a < nq;) {
    const int b = segment_end(s_ds, a, nq);
    const int64_t ds = s_ds[a], kb = s_kb[a];
    const int64_t n_max = (t0 + b - ds) / P;
    for (int64_t j0 = 0; j0 < n_max; j0 += kTile) {
      if (tid < kTile) s_coff[tid] = j0 + tid < n_max ? (kb + j0 + tid) * D : -1;
      __syncthreads();
      A s[4][4];
      tile_dot<kTile, true>(qh, s_roff, k, s_coff, D, As, Bs, s);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i;
        const bool in_seg = r >= a && r < b;
        const int64_t t = t0 + r;
        const int64_t lim = in_seg ? (t - ds + 1) / P - j0 : 0;  // visible columns of the tile
        A dwp = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx * 4 + j;
          const bool valid = c < lim;
          const A g = valid ? dsc[t * W + j0 + c] : A(0);
          dS[r * kLdB + c] = entry_grad(valid, g, wv[i], scale * s[i][j], scale, relu, dwp);
        }
        dwacc[i] += group16_sum(dwp);
      }
      tile_product<kTile>(k, s_coff, c_begin, D, dS, Cp, acc);
    }
    a = b;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    if (r >= nq) continue;
    const int64_t row = ((t0 + r) * H + h) * D;
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) {
      const int c = c_begin + part_col(tx, cc);
      if (c < D) st(dq, row + c, acc[i][cc]);
    }
    if (blockIdx.z == 0 && tx == 0) st(dw, (t0 + r) * H + h, dwacc[i]);
  }
}

// dk [nkeys, D] (one 128-channel part per blockIdx.y, one group of hpg heads per blockIdx.z):
// per key tile, its readers in query-tile order, the group's heads in order. With one group the
// block writes dk; else its partial sum goes to dk_part [groups, nkeys, D] (dense_dk_reduce adds
// the groups in order). cu / cp: the document and pool offsets [N+1]; the queries (q, w, dsc) are
// the rows of global tokens [q0, q0 + nq).
template <class TQ, class T, class A>
__global__ void __launch_bounds__(256, 2)
    dense_dk_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                    const A* __restrict__ dsc, const int64_t* __restrict__ cu,
                    const int64_t* __restrict__ cp, int64_t ndocs, int64_t q0, int64_t nq,
                    T* __restrict__ dk, A* __restrict__ dk_part, int64_t nkeys, int H, int hpg,
                    int D, int64_t W, int64_t P, A scale, bool relu) {
  using S = TileSmem<kTile>;
  extern __shared__ float4 smem4[];
  A* As = reinterpret_cast<A*>(smem4);
  A* Bs = As + kKc * S::kLdA;
  A* Cp = As;
  A* dS = As + S::kRegion;
  __shared__ int64_t s_doc[kTile], s_end[kTile], s_rel[kTile], s_first[kTile], s_roff[kTile],
      s_coff[kTile], s_t[kTile];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t s0 = int64_t(blockIdx.x) * kTile;
  const int c_begin = int(blockIdx.y) * kPart;
  const int h_begin = int(blockIdx.z) * hpg, h_end = std::min(H, h_begin + hpg);
  const int nk = int(std::min<int64_t>(kTile, nkeys - s0));
  if (tid < kTile) {
    if (tid < nk) {
      const int64_t s = s0 + tid, d = last_le(cp, ndocs + 1, s);
      const int64_t rel = s - cp[d];
      // The readers: the queries from the first that sees the key to the document's end, those
      // of the window [q0, q0 + nq), as its rows.
      const int64_t first = cu[d] + (rel + 1) * P - 1, end = cu[d + 1];
      s_doc[tid] = d;
      s_end[tid] = (end < q0 + nq ? end : q0 + nq) - q0;
      s_rel[tid] = rel;
      s_first[tid] = (first > q0 ? first : q0) - q0;
      s_roff[tid] = s * D;
    } else {
      s_doc[tid] = -1, s_end[tid] = 0, s_rel[tid] = 0, s_first[tid] = 0, s_roff[tid] = -1;
    }
  }
  __syncthreads();
  A acc[4][8] = {};
  for (int a = 0; a < nk;) {
    const int b = segment_end(s_doc, a, nk);
    const int64_t t_end = s_end[a];
    for (int64_t t0 = s_first[a]; t0 < t_end; t0 += kTile) {
      if (tid < kTile) {
        const bool v = t0 + tid < t_end;
        s_t[tid] = v ? t0 + tid : -1;
        s_coff[tid] = v ? (t0 + tid) * H * D : -1;
      }
      __syncthreads();
      for (int h = h_begin; h < h_end; ++h) {
        const TQ* qh = q + int64_t(h) * D;
        A s[4][4];
        tile_dot<kTile, true>(k, s_roff, qh, s_coff, D, As, Bs, s);
        A wv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t t = s_t[tx * 4 + j];
          wv[j] = t >= 0 ? ld<A>(w, t * H + h) : A(0);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = ty * 4 + i;
          const bool in_seg = r >= a && r < b;
          const int64_t first = s_first[r], rel = s_rel[r];
          A dwp = 0;  // unused here
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int c = tx * 4 + j;
            const int64_t t = s_t[c];
            const bool valid = in_seg && t >= first;
            const A g = valid ? dsc[t * W + rel] : A(0);
            dS[r * kLdB + c] = entry_grad(valid, g, wv[j], scale * s[i][j], scale, relu, dwp);
          }
        }
        tile_product<kTile>(qh, s_coff, c_begin, D, dS, Cp, acc);
      }
    }
    a = b;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    if (r >= nk) continue;
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) {
      const int c = c_begin + part_col(tx, cc);
      if (c >= D) continue;
      if (dk_part)
        dk_part[(int64_t(blockIdx.z) * nkeys + s0 + r) * D + c] = acc[i][cc];
      else
        st(dk, (s0 + r) * D + c, acc[i][cc]);
    }
  }
}

// dk[i] = sum of the head groups' partial sums, groups in order.
template <class T, class A>
__global__ void __launch_bounds__(256)
    dense_dk_reduce_kernel(const A* __restrict__ part, T* __restrict__ dk, int groups, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  A v = part[i];
  for (int g = 1; g < groups; ++g) v += part[g * n + i];
  st(dk, i, v);
}

// ---- explicit rows (pattern) layout ----

// One block per query: rows = heads (TM per tile), columns = 64 entries at a time.
template <int TM, class TQ, class T, class A>
__global__ void __launch_bounds__(TM * 4)
    rows_fwd_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                    const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ slot,
                    const int64_t* __restrict__ key, A* __restrict__ out, int H, int D, int64_t W,
                    A scale, bool relu) {
  using S = TileSmem<TM>;
  constexpr int NT = S::kThreads;
  extern __shared__ float4 smem4[];
  A* As = reinterpret_cast<A*>(smem4);
  A* Bs = As + kKc * S::kLdA;
  __shared__ int64_t s_roff[TM], s_coff[kTile];
  __shared__ A s_w[TM], s_red[TM / 4 * kTile];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t t = blockIdx.x;
  for (int64_t j = tid; j < W; j += NT) out[t * W + j] = neg_inf<A>();
  __syncthreads();  // entries overwrite some of these
  const int64_t e_begin = row_ptr[t], e_end = row_ptr[t + 1];
  for (int64_t e0 = e_begin; e0 < e_end; e0 += kTile) {
    const int ne = int(std::min<int64_t>(kTile, e_end - e0));
    A sacc = 0;  // the score of entry e0 + tid (threads < kTile)
    for (int h0 = 0; h0 < H; h0 += TM) {
      if (tid < TM) {
        const int h = h0 + tid;
        s_roff[tid] = h < H ? (t * H + h) * D : -1;
        s_w[tid] = h < H ? ld<A>(w, t * H + h) : A(0);
      }
      if (tid < kTile) s_coff[tid] = tid < ne ? key[e0 + tid] * D : -1;
      __syncthreads();
      A s[4][4];
      tile_dot<TM, false>(q, s_roff, k, s_coff, D, As, Bs, s);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        A p = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          A z = scale * s[i][j];
          if (relu) z = z > A(0) ? z : A(0);
          p = dfma(s_w[ty * 4 + i], z, p);
        }
        s_red[ty * kTile + tx * 4 + j] = p;
      }
      __syncthreads();
      if (tid < kTile)
        for (int y = 0; y < TM / 4; ++y) sacc += s_red[y * kTile + tid];
    }
    if (tid < ne) out[t * W + slot[e0 + tid]] = sacc;
  }
}

// One block per (query, 128-channel part): rows = heads, columns = the query's entries in slot
// order. dq [T, H, D], dw [T, H] (part 0).
template <int TM, class TQ, class T, class A>
__global__ void __launch_bounds__(TM * 4)
    rows_dq_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                   const A* __restrict__ dsc, const int64_t* __restrict__ row_ptr,
                   const int32_t* __restrict__ slot, const int64_t* __restrict__ key,
                   T* __restrict__ dq, T* __restrict__ dw, int H, int D, int64_t W, A scale,
                   bool relu) {
  using S = TileSmem<TM>;
  extern __shared__ float4 smem4[];
  A* As = reinterpret_cast<A*>(smem4);
  A* Bs = As + kKc * S::kLdA;
  A* Cp = As;
  A* dS = As + S::kRegion;
  __shared__ int64_t s_roff[TM], s_coff[kTile], s_col[kTile];
  __shared__ A s_w[TM];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t t = blockIdx.x;
  const int c_begin = int(blockIdx.y) * kPart;
  const int64_t e_begin = row_ptr[t], e_end = row_ptr[t + 1];
  for (int h0 = 0; h0 < H; h0 += TM) {
    if (tid < TM) {
      const int h = h0 + tid;
      s_roff[tid] = h < H ? (t * H + h) * D : -1;
      s_w[tid] = h < H ? ld<A>(w, t * H + h) : A(0);
    }
    A acc[4][8] = {};
    A dwacc[4] = {};
    for (int64_t e0 = e_begin; e0 < e_end; e0 += kTile) {
      if (tid < kTile) {
        const bool v = e0 + tid < e_end;
        s_coff[tid] = v ? key[e0 + tid] * D : -1;
        s_col[tid] = v ? slot[e0 + tid] : -1;
      }
      __syncthreads();
      A s[4][4];
      tile_dot<TM, true>(q, s_roff, k, s_coff, D, As, Bs, s);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i;
        const bool head = s_roff[r] >= 0;
        A dwp = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx * 4 + j;
          const bool valid = head && s_col[c] >= 0;
          const A g = valid ? dsc[t * W + s_col[c]] : A(0);
          dS[r * kLdB + c] = entry_grad(valid, g, s_w[r], scale * s[i][j], scale, relu, dwp);
        }
        dwacc[i] += group16_sum(dwp);
      }
      tile_product<TM>(k, s_coff, c_begin, D, dS, Cp, acc);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = h0 + ty * 4 + i;
      if (h >= H) continue;
      const int64_t row = (t * H + h) * D;
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
        const int c = c_begin + part_col(tx, cc);
        if (c < D) st(dq, row + c, acc[i][cc]);
      }
      if (blockIdx.y == 0 && tx == 0) st(dw, t * H + h, dwacc[i]);
    }
    __syncthreads();  // s_roff / s_w are rewritten by the next head tile
  }
}

// One block of kDkWarps warps per key: dk [nkeys, D] gathered over the key's readers (the inverse
// map, increasing (t, slot)), kDkWarps readers at a time. Shared memory: k row, the warps'
// partial rows g [kDkWarps][D], the accumulator [D]. QR > 0 (D <= 32 QR): each lane keeps its QR
// channels of q[t, h] and of g in registers, so q is read once; QR = 0: any D, q read twice.
template <int QR, class TQ, class T, class A>
__global__ void __launch_bounds__(kDkWarps * 32)
    rows_dk_kernel(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ w,
                   const A* __restrict__ dsc, const int32_t* __restrict__ slot,
                   const int64_t* __restrict__ query, const int64_t* __restrict__ key_ptr,
                   const int64_t* __restrict__ key_entry, T* __restrict__ dk, int H, int D,
                   int64_t W, A scale, bool relu) {
  constexpr int NT = kDkWarps * 32;
  extern __shared__ float4 smem4[];
  A* Ks = reinterpret_cast<A*>(smem4);
  A* G = Ks + D;
  A* acc = G + kDkWarps * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t s = blockIdx.x;
  for (int c = tid; c < D; c += NT) {
    Ks[c] = ld<A>(k, s * D + c);
    acc[c] = A(0);
  }
  __syncthreads();
  const int64_t r_begin = key_ptr[s], r_end = key_ptr[s + 1];
  A* Gw = G + warp * D;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kDkWarps) {
    const int64_t r = r0 + warp;
    if (r < r_end) {  // warp-uniform
      const int64_t e = key_entry[r], t = query[e];
      const A g = dsc[t * W + slot[e]];
      if constexpr (QR > 0) {
        A kv[QR], gv[QR] = {};
#pragma unroll
        for (int i = 0; i < QR; ++i) kv[i] = lane + 32 * i < D ? Ks[lane + 32 * i] : A(0);
        for (int h = 0; h < H; ++h) {
          const TQ* qr = q + (t * H + h) * D;
          A qv[QR], part = 0;
#pragma unroll
          for (int i = 0; i < QR; ++i) {
            qv[i] = lane + 32 * i < D ? ld<A>(qr, lane + 32 * i) : A(0);
            part = dfma(qv[i], kv[i], part);
          }
          A dwp = 0;
          const A dz =
              entry_grad(true, g, ld<A>(w, t * H + h), scale * warp_sum(part), scale, relu, dwp);
#pragma unroll
          for (int i = 0; i < QR; ++i) gv[i] = dfma(dz, qv[i], gv[i]);
        }
#pragma unroll
        for (int i = 0; i < QR; ++i)
          if (lane + 32 * i < D) Gw[lane + 32 * i] = gv[i];
      } else {
        for (int c = lane; c < D; c += 32) Gw[c] = A(0);
        for (int h = 0; h < H; ++h) {
          const TQ* qr = q + (t * H + h) * D;
          A part = 0;
          for (int c = lane; c < D; c += 32) part = dfma(ld<A>(qr, c), Ks[c], part);
          A dwp = 0;
          const A dz =
              entry_grad(true, g, ld<A>(w, t * H + h), scale * warp_sum(part), scale, relu, dwp);
          for (int c = lane; c < D; c += 32) Gw[c] = dfma(dz, ld<A>(qr, c), Gw[c]);
        }
      }
    } else {
      for (int c = lane; c < D; c += 32) Gw[c] = A(0);
    }
    __syncthreads();
    for (int c = tid; c < D; c += NT) {
      A v = acc[c];
      for (int x = 0; x < kDkWarps; ++x) v += G[x * D + c];
      acc[c] = v;
    }
    __syncthreads();
  }
  for (int c = tid; c < D; c += NT) st(dk, s * D + c, acc[c]);
}

// ---- host side ----

// Opts `kernel` in to `bytes` of dynamic shared memory (with its static shared memory, a block may
// pass the 48 KiB default even when `bytes` alone does not).
void allow_smem(const void* kernel, size_t bytes, const char* op) {
  const int optin = smem_optin();
  HLM_CHECK(size_t(optin) >= bytes,
            "{}: a block needs {} bytes of shared memory, the device allows {} (d_I too large?)",
            op, bytes, optin);
  set_smem(kernel, bytes, op);
}

int parts_of(int64_t D) {
  return int(std::max<int64_t>(1, (D + kPart - 1) / kPart));
}

// The tensors the scoring kernels read: q and k themselves, or under opt.fp8 their dequantised
// copies in the computation dtype (plus the device flag of a non-finite value).
struct ScoreInputs {
  Tensor q, k;  // what the kernels read
  Tensor bad;   // i32 [1] (FP8 emulation only)
  const Tensor* q_in = nullptr;
  const Tensor* k_in = nullptr;
};

template <class T>
Tensor fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, Tensor& bad) {
  using A = acc_t<T>;
  const int64_t D = x.size(-1), rows = D > 0 ? x.numel() / D : 0;
  Tensor out = alloc(x.shape(), compute_dtype(x.dtype()));
  const int nb = int((D + 127) / 128);
  const int64_t warps = rows * nb;
  if (warps == 0) return out;
  fp8_emulate_kernel<T, A><<<blocks_for(warps * 32, 256), 256>>>(
      cptr<T>(x), mptr<A>(out), rows, int(D), nb, float(opt.fp8_amax_floor), opt.fp8_pow2,
      mptr<int>(bad));
  check_launch("fp8_emulate");
  return out;
}

template <class T>
ScoreInputs score_inputs(const Tensor& q, const Tensor& k, const IndexerScoreOptions& opt) {
  ScoreInputs in;
  in.q_in = &q, in.k_in = &k;
  if (!opt.fp8) {
    in.q = q, in.k = k;
    return in;
  }
  in.bad = alloc({1}, DType::i32);
  in.bad.zero_();
  in.q = fp8_emulate<T>(q, opt, in.bad);
  in.k = fp8_emulate<T>(k, opt, in.bad);
  return in;
}

// After the kernels are queued: the CPU's error for a non-finite q or k under the FP8 emulation.
// The CPU's error for the first non-finite value of x (found on the host, after the device flagged
// one).
void throw_non_finite(const Tensor& x, const char* op, const char* what) {
  const int64_t D = x.size(-1);
  const std::vector<double> v = x.to(Device::cpu).to_f64_vector();
  for (size_t i = 0; i < v.size(); ++i)
    HLM_CHECK(std::isfinite(float(v[i])),
              "{}: fp8 emulation: {} holds a non-finite value at row {}, channel {}", op, what,
              int64_t(i) / D, int64_t(i) % D);
}

bool flagged(const Tensor& bad) {
  return bad.defined() && bad.to(Device::cpu).data<int>()[0] != 0;
}

void check_fp8_inputs(const ScoreInputs& in, const char* op) {
  if (!flagged(in.bad)) return;
  throw_non_finite(*in.q_in, op, "q");
  throw_non_finite(*in.k_in, op, "k");
}

// f(T{}, TQ{}): T the storage type of q, k, w; TQ that of what the kernels read as q and k.
template <class F>
void dispatch_score(DType dt, bool fp8, F&& f) {
  dispatch_storage(dt, [&](auto tag) {
    using T = decltype(tag);
    if (fp8)
      f(T{}, acc_t<T>{});
    else
      f(T{}, T{});
  });
}

}  // namespace

void indexer_scores_dense(const Tensor& q, const Tensor& k, const Tensor& w,
                          const dsa_detail::QueryWindow& win, const IndexerScoreOptions& opt,
                          double scale, Tensor& scores, const char* op) {
  const int64_t T_ = q.size(0), W = scores.size(1);
  const int H = int(q.size(1)), D = int(q.size(2));
  if (T_ == 0 || W == 0) return;
  const DsaLayoutDev lay = upload_layout(win, opt.pool);
  dispatch_storage(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const ScoreInputs in = score_inputs<T>(q, k, opt);
    const dim3 grid(unsigned((W + kTile - 1) / kTile), unsigned((T_ + kTile - 1) / kTile));
    const size_t smem = size_t(TileSmem<kTile>::kFwd) * sizeof(A);
    auto run = [&](auto tq) {
      using TQ = decltype(tq);
      allow_smem(reinterpret_cast<const void*>(&dense_fwd_kernel<TQ, T, A>), smem, op);
      dense_fwd_kernel<TQ, T, A><<<grid, 256, smem>>>(
          cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<int64_t>(lay.doc_start),
          cptr<int64_t>(lay.key_base), mptr<A>(scores), T_, H, D, W, opt.pool, A(scale), opt.relu);
      check_launch("indexer_scores dense");
    };
    if (opt.fp8)
      run(A{});
    else
      run(T{});
    check_fp8_inputs(in, op);
  });
}

void indexer_scores_rows(const Tensor& q, const Tensor& k, const Tensor& w, const DsaPatternDev& pd,
                         const IndexerScoreOptions& opt, double scale, Tensor& scores,
                         const char* op) {
  const int64_t T_ = q.size(0), W = pd.W;
  const int H = int(q.size(1)), D = int(q.size(2));
  if (T_ == 0 || W == 0) return;
  dispatch_storage(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const ScoreInputs in = score_inputs<T>(q, k, opt);
    auto run = [&](auto tq, auto tm) {
      using TQ = decltype(tq);
      constexpr int TM = decltype(tm)::value;
      const size_t smem = size_t(TileSmem<TM>::kFwd) * sizeof(A);
      allow_smem(reinterpret_cast<const void*>(&rows_fwd_kernel<TM, TQ, T, A>), smem, op);
      rows_fwd_kernel<TM, TQ, T, A><<<unsigned(T_), TM * 4, smem>>>(
          cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<int64_t>(pd.row_ptr),
          cptr<int32_t>(pd.slot), cptr<int64_t>(pd.key), mptr<A>(scores), H, D, W, A(scale),
          opt.relu);
      check_launch("indexer_scores rows");
    };
    auto by_tm = [&](auto tq) {
      if (H <= 32)
        run(tq, std::integral_constant<int, 32>{});
      else
        run(tq, std::integral_constant<int, kTile>{});
    };
    if (opt.fp8)
      by_tm(A{});
    else
      by_tm(T{});
    check_fp8_inputs(in, op);
  });
}

Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what, Tensor* nonfinite) {
  Tensor out;
  dispatch_storage(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (nonfinite) {
      out = fp8_emulate<T>(x, opt, *nonfinite);
      return;
    }
    Tensor bad = alloc({1}, DType::i32);
    bad.zero_();
    out = fp8_emulate<T>(x, opt, bad);
    if (flagged(bad)) throw_non_finite(x, op, what);
  });
  return out;
}

void indexer_scores_dense_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                   const dsa_detail::QueryWindow& win,
                                   const IndexerScoreOptions& opt, double scale,
                                   const Tensor& d_scores, IndexerScoreGrads& g, const char* op) {
  const int64_t T_ = q.size(0), W = d_scores.size(1), nkeys = k.size(0);
  const int H = int(q.size(1)), D = int(q.size(2));
  const int parts = parts_of(D);
  const std::vector<int64_t>& cu = win.cu;
  const DsaLayoutDev lay = upload_layout(win, opt.pool);
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, opt.pool);
  const Tensor cu_dev = to_device(cu), cp_dev = to_device(cp);
  const int64_t ndocs = int64_t(cu.size()) - 1;
  dispatch_storage(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const ScoreInputs in = score_inputs<T>(q, k, opt);
    const size_t smem = size_t(TileSmem<kTile>::kBwd) * sizeof(A);
    auto run = [&](auto tq) {
      using TQ = decltype(tq);
      if (T_ > 0 && H > 0) {
        allow_smem(reinterpret_cast<const void*>(&dense_dq_kernel<TQ, T, A>), smem, op);
        const dim3 grid(unsigned((T_ + kTile - 1) / kTile), unsigned(H), unsigned(parts));
        dense_dq_kernel<TQ, T, A><<<grid, 256, smem>>>(
            cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<A>(d_scores),
            cptr<int64_t>(lay.doc_start), cptr<int64_t>(lay.key_base), mptr<T>(g.dq), mptr<T>(g.dw),
            T_, H, D, W, opt.pool, A(scale), opt.relu);
        check_launch("indexer_scores_backward dense dq");
      }
      if (nkeys > 0) {
        // Heads split into groups until the grid has about kDkTargetBlocks blocks (the first key
        // tiles have the most readers: a block per key tile alone would leave the GPU idle).
        const int64_t tiles = (nkeys + kTile - 1) / kTile;
        const int64_t want =
            std::clamp<int64_t>(kDkTargetBlocks / (tiles * parts), 1, std::max(H, 1));
        const int hpg = int((std::max(H, 1) + want - 1) / want);
        const int groups = (std::max(H, 1) + hpg - 1) / hpg;
        Tensor part;
        if (groups > 1) part = alloc({groups, nkeys, int64_t(D)}, compute_dtype(q.dtype()));
        allow_smem(reinterpret_cast<const void*>(&dense_dk_kernel<TQ, T, A>), smem, op);
        const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(parts),
                        static_cast<unsigned>(groups));
        dense_dk_kernel<TQ, T, A>
            <<<grid, 256, smem>>>(cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<A>(d_scores),
                                  cptr<int64_t>(cu_dev), cptr<int64_t>(cp_dev), ndocs, win.q0, T_,
                                  mptr<T>(g.dk), groups > 1 ? mptr<A>(part) : nullptr, nkeys, H,
                                  hpg, D, W, opt.pool, A(scale), opt.relu);
        check_launch("indexer_scores_backward dense dk");
        const int64_t n = nkeys * D;
        if (groups > 1 && n > 0) {
          dense_dk_reduce_kernel<T, A>
              <<<blocks_for(n, 256), 256>>>(cptr<A>(part), mptr<T>(g.dk), groups, n);
          check_launch("indexer_scores_backward dense dk reduce");
        }
      }
    };
    if (opt.fp8)
      run(A{});
    else
      run(T{});
    check_fp8_inputs(in, op);
  });
}

void indexer_scores_rows_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                  const DsaPatternDev& pd, const IndexerScoreOptions& opt,
                                  double scale, const Tensor& d_scores, IndexerScoreGrads& g,
                                  const char* op) {
  const int64_t T_ = q.size(0), W = pd.W, nkeys = k.size(0);
  const int H = int(q.size(1)), D = int(q.size(2));
  const int parts = parts_of(D);
  dispatch_storage(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const ScoreInputs in = score_inputs<T>(q, k, opt);
    auto run = [&](auto tq, auto tm) {
      using TQ = decltype(tq);
      constexpr int TM = decltype(tm)::value;
      if (T_ > 0 && H > 0) {
        const size_t smem = size_t(TileSmem<TM>::kBwd) * sizeof(A);
        allow_smem(reinterpret_cast<const void*>(&rows_dq_kernel<TM, TQ, T, A>), smem, op);
        rows_dq_kernel<TM, TQ, T, A><<<dim3(unsigned(T_), unsigned(parts)), TM * 4, smem>>>(
            cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<A>(d_scores),
            cptr<int64_t>(pd.row_ptr), cptr<int32_t>(pd.slot), cptr<int64_t>(pd.key), mptr<T>(g.dq),
            mptr<T>(g.dw), H, D, W, A(scale), opt.relu);
        check_launch("indexer_scores_at_backward dq");
      }
      if (nkeys > 0) {
        const size_t smem = size_t(D) * (kDkWarps + 2) * sizeof(A);
        auto launch_dk = [&](auto qr) {
          constexpr int QR = decltype(qr)::value;
          allow_smem(reinterpret_cast<const void*>(&rows_dk_kernel<QR, TQ, T, A>), smem, op);
          rows_dk_kernel<QR, TQ, T, A><<<unsigned(nkeys), kDkWarps * 32, smem>>>(
              cptr<TQ>(in.q), cptr<TQ>(in.k), cptr<T>(w), cptr<A>(d_scores), cptr<int32_t>(pd.slot),
              cptr<int64_t>(pd.query), cptr<int64_t>(pd.key_ptr), cptr<int64_t>(pd.key_entry),
              mptr<T>(g.dk), H, D, W, A(scale), opt.relu);
          check_launch("indexer_scores_at_backward dk");
        };
        if (D <= 128)
          launch_dk(std::integral_constant<int, 4>{});
        else
          launch_dk(std::integral_constant<int, 0>{});
      }
    };
    auto by_tm = [&](auto tq) {
      if (H <= 32)
        run(tq, std::integral_constant<int, 32>{});
      else
        run(tq, std::integral_constant<int, kTile>{});
    };
    if (opt.fp8)
      by_tm(A{});
    else
      by_tm(T{});
    check_fp8_inputs(in, op);
  });
}

}  // namespace hlm::ops::cuda
