// mHC on CUDA (ops/cuda/mhc.cuh), the math and the summation orders of ops/cpu/mhc.cpp
// (docs/mhc_moe.md, "mHC on CUDA"). A is the computation type: double when the op computes in
// f64, else float. Every input is read through In<A>, which carries its dtype (f32, f64 or bf16)
// at run time, so a bf16 x next to an f32 y or f64 parameters needs no conversion pass; outputs
// in the computation dtype are plain A arrays, the others (u, X', expand, contract) go through
// Out<A>, which rounds once to their dtype.
//
// Kernels (n <= 8 streams; NM = 4 for n <= 4, else 8: per-thread arrays of NM or NM x NM values,
// indexed only by unrolled loop counters so that they stay in registers):
//   elementwise, one thread per output element (grid-stride): collapse, write-back, expand, stream
//     sum (expand backward, mean contract), mean-contract backward, post sum, add3, the inv_rms
//     backward's row scaling, the accumulation of a parameter gradient;
//   one 256-thread block per token, with a fixed-order block sum (each thread sums its elements
//     in order, an xor-butterfly warp sum, then the 8 warp sums in warp order): inv_rms,
//     collapse backward (the n dot products <du, X_j>), write-back backward (the n + n^2 dot
//     products <dX'_i, y>, <dX'_i, X_j>);
//   one thread per token: Sinkhorn forward, Sinkhorn backward (the forward's 2 iters matrices and
//     2 iters - 1 sum vectors go to a workspace [step][entry][T], coalesced across tokens), the
//     mappings' per-token epilogue (mix scaling, sigmoids, logits, Sinkhorn) and the mappings
//     backward's per-token part (sigmoid and Sinkhorn backward, dp, d inv_rms); the operations
//     inside run in the CPU's order, so f32 / f64 results differ from the CPU only by the
//     rounding of exp and of contracted multiply-adds;
//   inference's collapse + norm (mhc_collapse_norm), for a decode step's few tokens: the
//     projection and the sum of squares over slices of flat, a block per (slice, token), then a
//     block per token for the slices' sums in slice order, the mappings, the collapse and the
//     norm (below, "Inference");
//   the mappings' projection fn @ flat, dx += dp @ fn and d fn = dp^T flat run as ops::gemm
//     (cuBLAS); d base and d scale sum the tokens in parts of 64 (in order), then the parts in
//     order. Parameter gradients are added to their accumulators in f64 and rounded once to the
//     accumulator's dtype, as the CPU does.
// No atomics: every output element is written by one thread from a fixed-order sum, so two runs
// give the same bits.
// Faster: 16-byte vector accesses for the elementwise kernels, fusing collapse into the mappings
// epilogue (pre is known there), and a fused projection that reads x once for inv_rms and fn @
// flat (today x is read by the inv_rms kernel and again by the GEMM).
#include <algorithm>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/mhc.cuh"
#include "ops/gemm.h"
#include "ops/tensor_ops.h"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;     // block-per-token and elementwise kernels
constexpr int kTokThreads = 128;  // thread-per-token kernels
constexpr int kWarps = kThreads / 32;
constexpr int64_t kTokensPerPart = 64;
constexpr int64_t kMaxBlocks = 65535;

enum : int { kF32 = 0, kF64 = 1, kBf16 = 2 };

int code_of(DType dt) {
  switch (dt) {
    case DType::f32:
      return kF32;
    case DType::f64:
      return kF64;
    case DType::bf16:
      return kBf16;
    default:
      HLM_FAIL("mHC on CUDA: unsupported dtype {} (f32, f64 or bf16)", dtype_name(dt));
  }
}

// A contiguous device tensor of f32 / f64 / bf16, read as A (a null pointer reads as zero).
template <class A>
struct In {
  const void* p;
  int dt;
  __device__ __forceinline__ A operator[](int64_t i) const {
    if (p == nullptr) return A(0);
    if (dt == kF32) return A(static_cast<const float*>(p)[i]);
    if (dt == kF64) return A(static_cast<const double*>(p)[i]);
    return A(__bfloat162float(static_cast<const nv_bf16*>(p)[i]));
  }
};
// A contiguous device tensor of f32 / f64 / bf16 written from A (rounded once).
template <class A>
struct Out {
  void* p;
  int dt;
  __device__ __forceinline__ void set(int64_t i, A v) const {
    if (dt == kF32) {
      static_cast<float*>(p)[i] = float(v);
    } else if (dt == kF64) {
      static_cast<double*>(p)[i] = double(v);
    } else {
      static_cast<nv_bf16*>(p)[i] = __float2bfloat16_rn(float(v));
    }
  }
};

template <class A>
In<A> in_of(const Tensor& t) {
  if (!t.defined()) return {nullptr, kF32};
  return {t.raw(), code_of(t.dtype())};
}
template <class A>
Out<A> out_of(const Tensor& t) {
  return {t.raw(), code_of(t.dtype())};
}

// The tensor contiguous on its device (itself when it already is).
Tensor cont(const Tensor& t) {
  return t.defined() ? ops::contiguous(t) : t;
}

template <class F>
void dispatch_acc(DType dt, F&& f) {
  if (dt == DType::f64) {
    f(double{});
  } else {
    f(float{});
  }
}

// f(integral_constant<int, NM>) with NM = 4 for n <= 4, else 8.
template <class F>
void dispatch_nm(int64_t n, F&& f) {
  HLM_CHECK(n >= 1 && n <= kMhcMaxStreams, "mHC on CUDA: n = {} streams, must be in [1, {}]", n,
            kMhcMaxStreams);
  if (n <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

unsigned grid_for(int64_t n, int threads = kThreads) {
  return std::max<unsigned>(1, std::min<unsigned>(blocks_for(n, threads), unsigned(kMaxBlocks)));
}

#define HLM_GRID_STRIDE(i, n)                                               \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// ---- block sums
// ---------------------------------------------------------------------------------- The sums over
// the block's threads of v[0 .. V): each warp by an xor butterfly, then the warp sums in warp
// order. Thread k < V returns the sum of v[k]; the others return 0. red: kWarps * V shared. Every
// thread of the block must call it.
template <int V, class A>
__device__ __forceinline__ A block_sums(const A (&v)[V], A* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const A s = warp_sum(v[k]);
    if (lane == 0) red[warp * V + k] = s;
  }
  __syncthreads();
  A s = 0;
  if (int(threadIdx.x) < V) {
    s = red[threadIdx.x];
    for (int w = 1; w < kWarps; ++w) s += red[w * V + threadIdx.x];
  }
  return s;
}

// ---- Sinkhorn, one token per thread
// ---------------------------------------------------------------- M [NM x NM] row-major (entries
// i, j < n used). Workspace layout (when hist is non-null): matrix h (h = 0 the softmax, h = st + 1
// the result of step st) entry k = i n + j at hist[(h n^2 + k) T + t]; the sums of step st at
// sums[(st n + a) T + t].
template <int NM, class A>
__device__ __forceinline__ void sk_store(const A (&M)[NM * NM], int n, A* hist, int64_t h,
                                         int64_t T, int64_t t) {
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (i < n && j < n) hist[(h * n * n + i * n + j) * T + t] = M[i * NM + j];
}

// In: the logits in M; out: comb in M. The CPU's sinkhorn_token step for step.
template <int NM, class A>
__device__ __forceinline__ void sk_forward(A (&M)[NM * NM], int n, A eps, int64_t iters, A* hist,
                                           A* sums, int64_t T, int64_t t) {
#pragma unroll
  for (int i = 0; i < NM; ++i) {
    if (i < n) {
      A mx = M[i * NM];
#pragma unroll
      for (int j = 1; j < NM; ++j)
        if (j < n) mx = mx < M[i * NM + j] ? M[i * NM + j] : mx;
      A s = 0;
#pragma unroll
      for (int j = 0; j < NM; ++j)
        if (j < n) {
          M[i * NM + j] = dexp(M[i * NM + j] - mx);
          s += M[i * NM + j];
        }
#pragma unroll
      for (int j = 0; j < NM; ++j)
        if (j < n) M[i * NM + j] /= s;
    }
  }
  if (hist) sk_store<NM>(M, n, hist, 0, T, t);
#pragma unroll
  for (int k = 0; k < NM * NM; ++k) M[k] += eps;
  const int64_t steps = 2 * iters - 1;  // col, then (row, col) x (iters - 1)
  for (int64_t st = 0; st < steps; ++st) {
    const bool col = (st % 2) == 0;
    A s[NM];
#pragma unroll
    for (int a = 0; a < NM; ++a) {
      A acc = 0;
#pragma unroll
      for (int b = 0; b < NM; ++b)
        if (b < n) acc += col ? M[b * NM + a] : M[a * NM + b];
      s[a] = acc + eps;
    }
#pragma unroll
    for (int i = 0; i < NM; ++i)
#pragma unroll
      for (int j = 0; j < NM; ++j) M[i * NM + j] /= col ? s[j] : s[i];
    if (hist) {
      sk_store<NM>(M, n, hist, st + 1, T, t);
#pragma unroll
      for (int a = 0; a < NM; ++a)
        if (a < n) sums[(st * n + a) * T + t] = s[a];
    }
  }
}

// In: dcomb in g; out: dlogits in g. Reads the workspace sk_forward wrote for token t.
template <int NM, class A>
__device__ __forceinline__ void sk_backward(A (&g)[NM * NM], int n, int64_t iters, const A* hist,
                                            const A* sums, int64_t T, int64_t t) {
  const int64_t steps = 2 * iters - 1;
  const int64_t nn = int64_t(n) * n;
  // Step st maps M_in -> M_out = M_in / s (s along rows, or columns for a col step):
  // dM_in[i][j] = (g[i][j] - sum_k g[i][k] M_out[i][k]) / s_i (col step transposed).
  for (int64_t st = steps - 1; st >= 0; --st) {
    const bool col = (st % 2) == 0;
    const A* Mo = hist + (st + 1) * nn * T + t;
    A r[NM], s[NM];
#pragma unroll
    for (int a = 0; a < NM; ++a) {
      A acc = 0;
#pragma unroll
      for (int b = 0; b < NM; ++b)
        if (a < n && b < n) {
          const int k = col ? b * NM + a : a * NM + b;
          const int kc = col ? b * n + a : a * n + b;
          acc += g[k] * Mo[int64_t(kc) * T];
        }
      r[a] = acc;
      s[a] = a < n ? sums[(st * n + a) * T + t] : A(1);
    }
#pragma unroll
    for (int i = 0; i < NM; ++i)
#pragma unroll
      for (int j = 0; j < NM; ++j)
        g[i * NM + j] = col ? (g[i * NM + j] - r[j]) / s[j] : (g[i * NM + j] - r[i]) / s[i];
  }
  // softmax (the + eps has zero gradient): dL_ij = P_ij (g_ij - sum_k g_ik P_ik)
  const A* P = hist + t;
#pragma unroll
  for (int i = 0; i < NM; ++i) {
    if (i < n) {
      A acc = 0;
#pragma unroll
      for (int k = 0; k < NM; ++k)
        if (k < n) acc += g[i * NM + k] * P[int64_t(i * n + k) * T];
#pragma unroll
      for (int j = 0; j < NM; ++j)
        if (j < n) {
          const A p = P[int64_t(i * n + j) * T];
          g[i * NM + j] = p * (g[i * NM + j] - acc);
        }
    }
  }
}

// Rows of the Sinkhorn workspace: 2 iters matrices of n^2, 2 iters - 1 sum vectors of n.
int64_t sk_ws_rows(int64_t n, int64_t iters) {
  return 2 * iters * n * n + (2 * iters - 1) * n;
}

template <int NM, class A>
__device__ __forceinline__ void load_mat(A (&M)[NM * NM], In<A> src, int64_t base, int n) {
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j) M[i * NM + j] = (i < n && j < n) ? src[base + i * n + j] : A(0);
}

template <int NM, class A>
__global__ void __launch_bounds__(kTokThreads)
    sinkhorn_fwd_kernel(In<A> L, A* __restrict__ out, int64_t T, int n, A eps, int64_t iters) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t nn = int64_t(n) * n;
  A M[NM * NM];
  load_mat<NM>(M, L, t * nn, n);
  sk_forward<NM>(M, n, eps, iters, static_cast<A*>(nullptr), static_cast<A*>(nullptr), T, t);
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (i < n && j < n) out[t * nn + i * n + j] = M[i * NM + j];
}

template <int NM, class A>
__global__ void __launch_bounds__(kTokThreads)
    sinkhorn_bwd_kernel(In<A> L, In<A> dcomb, A* __restrict__ dL, A* __restrict__ ws, int64_t T,
                        int n, A eps, int64_t iters) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t nn = int64_t(n) * n;
  A* hist = ws;
  A* sums = ws + 2 * iters * nn * T;
  A M[NM * NM];
  load_mat<NM>(M, L, t * nn, n);
  sk_forward<NM>(M, n, eps, iters, hist, sums, T, t);
  load_mat<NM>(M, dcomb, t * nn, n);
  sk_backward<NM>(M, n, iters, hist, sums, T, t);
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (i < n && j < n) dL[t * nn + i * n + j] = M[i * NM + j];
}

// ---- mappings
// ------------------------------------------------------------------------------------

// inv_rms[t] = 1 / sqrt(sum_k x[t, k]^2 / K + eps), one block per token.
template <class A>
__global__ void __launch_bounds__(kThreads)
    inv_rms_kernel(In<A> x, A* __restrict__ ir, int64_t K, A eps) {
  __shared__ A red[kWarps];
  const int64_t t = blockIdx.x;
  A v[1] = {A(0)};
  for (int64_t k = threadIdx.x; k < K; k += kThreads) {
    const A a = x[t * K + k];
    v[0] += a * a;
  }
  const A ss = block_sums<1>(v, red);
  if (threadIdx.x == 0) ir[t] = A(1) / dsqrt(ss / A(K) + eps);
}

// One token's mappings from its projection mt [(2+n) n] (fn @ flat, scaled here by inv_rms in
// place): pre, post [n], the comb logits (Lg; null: not kept) and comb [n, n].
template <int NM, class A>
__device__ __forceinline__ void maps_token(A* mt, A inv, In<A> base, In<A> scale, A* pre, A* post,
                                           A* Lg, A* comb, int n, A heps, int64_t iters) {
  const int64_t m = int64_t(2 + n) * n;
  for (int64_t q = 0; q < m; ++q) mt[q] = mt[q] * inv;
  const A s0 = scale[0], s1 = scale[1], s2 = scale[2];
  for (int j = 0; j < n; ++j) {
    pre[j] = dsigmoid(mt[j] * s0 + base[j]) + heps;
    post[j] = A(2) * dsigmoid(mt[n + j] * s1 + base[n + j]);
  }
  A M[NM * NM];
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j) {
      A v = 0;
      if (i < n && j < n) {
        const int q = i * n + j;
        v = mt[2 * n + q] * s2 + base[2 * n + q];
        if (Lg) Lg[q] = v;
      }
      M[i * NM + j] = v;
    }
  sk_forward<NM>(M, n, heps, iters, static_cast<A*>(nullptr), static_cast<A*>(nullptr), 1, 0);
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (i < n && j < n) comb[i * n + j] = M[i * NM + j];
}

// One token's mappings by one warp (every lane calls it), for a decode step's few tokens: the
// same operations in the same order as maps_token (no test compares their bits: the inputs of
// the two paths differ already, by the projection's order), with the entries spread over
// the lanes instead of one thread's serial loop (which took 29-38 us a token on an H100, ncu).
// Lane l holds the comb entries q = l + 32 e (e < kE,
// row q / n, column q % n); a row's or a column's sum gathers its n entries by shuffles, in
// index order, as the serial loop adds them. mt: the token's projection [m] (unscaled, read
// only). Writes pre and post [n] (and spre, shared) and comb [n, n].
template <int NM, class A>
__device__ __forceinline__ void maps_token_warp(const A* mt, A inv, In<A> base, In<A> scale, A* pre,
                                                A* post, A* spre, A* comb, int n, A heps,
                                                int64_t iters) {
  constexpr int kE = (NM * NM + 31) / 32;
  const int lane = threadIdx.x & 31, nn = n * n;
  const A s0 = scale[0], s1 = scale[1], s2 = scale[2];
  if (lane < n) {
    const A hp = mt[lane] * inv, hq = mt[n + lane] * inv;
    const A pj = dsigmoid(hp * s0 + base[lane]) + heps;
    pre[lane] = pj;
    spre[lane] = pj;
    post[lane] = A(2) * dsigmoid(hq * s1 + base[n + lane]);
  }
  A v[kE];
  int row[kE], col[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int q = lane + 32 * e, qc = q < nn ? q : 0;  // lanes past n^2 shadow entry 0
    row[e] = qc / n;
    col[e] = qc % n;
    v[e] = q < nn ? (mt[2 * n + q] * inv) * s2 + base[2 * n + q] : A(0);
  }
  // Entry q of the matrix, in every lane (each lane may ask for another q).
  auto at = [&](int q) {
    A r = 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const A t = __shfl_sync(0xffffffffu, v[e], q & 31);
      if ((q >> 5) == e) r = t;
    }
    return r;
  };
  // Softmax of each row (max, exp, sum in column order, divide), then + eps.
  A mx[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) mx[e] = at(row[e] * n);
  for (int j = 1; j < n; ++j)
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const A t = at(row[e] * n + j);
      mx[e] = mx[e] < t ? t : mx[e];
    }
#pragma unroll
  for (int e = 0; e < kE; ++e) v[e] = dexp(v[e] - mx[e]);
  A sum[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) sum[e] = A(0);
  for (int j = 0; j < n; ++j)
#pragma unroll
    for (int e = 0; e < kE; ++e) sum[e] += at(row[e] * n + j);
#pragma unroll
  for (int e = 0; e < kE; ++e) v[e] = v[e] / sum[e] + heps;
  // Column, then (row, column) x (iters - 1): each entry divided by its column's (row's) sum + eps.
  const int64_t steps = 2 * iters - 1;
  for (int64_t st = 0; st < steps; ++st) {
    const bool by_col = (st % 2) == 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) sum[e] = A(0);
    for (int b = 0; b < n; ++b)
#pragma unroll
      for (int e = 0; e < kE; ++e) sum[e] += at(by_col ? b * n + col[e] : row[e] * n + b);
#pragma unroll
    for (int e = 0; e < kE; ++e) v[e] /= sum[e] + heps;
  }
#pragma unroll
  for (int e = 0; e < kE; ++e)
    if (lane + 32 * e < nn) comb[lane + 32 * e] = v[e];
}

// Per token: mix = proj * inv_rms (in place), pre, post, the comb logits and comb.
template <int NM, class A>
__global__ void __launch_bounds__(kTokThreads)
    maps_epilogue_kernel(A* __restrict__ mix, const A* __restrict__ ir, In<A> base, In<A> scale,
                         A* __restrict__ pre, A* __restrict__ post, A* __restrict__ Lg,
                         A* __restrict__ comb, int64_t T, int n, A heps, int64_t iters) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t m = int64_t(2 + n) * n, nn = int64_t(n) * n;
  maps_token<NM>(mix + t * m, ir[t], base, scale, pre + t * n, post + t * n, Lg + t * nn,
                 comb + t * nn, n, heps, iters);
}

// Inference (a decode step's few tokens), in two kernels. The first sums the mappings'
// projection over slices of flat: block (s, t) of a (slices, T) grid takes flat[t, s kSlice ..
// (s + 1) kSlice), each lane holding 8 of its elements in registers, and writes the slice's m
// dot products with the rows of fn and its sum of squares to part[t, s, 0 .. m]; warp w takes
// rows w, w + 8, ... (row m: the squares), each lane's 8 products in order, then a warp sum. The
// reads of fn are coalesced and spread over slices x T blocks (one block per token reading the
// whole projection, with the mappings in one thread, took 118.5 us a site on an H100).
constexpr int64_t kSlice = 256;  // elements of flat per block: 8 per lane
constexpr int kPerLane = int(kSlice / 32);

template <class A>
__global__ void __launch_bounds__(kThreads)
    collapse_norm_part_kernel(In<A> x, In<A> fn, A* __restrict__ part, int m, int64_t K) {
  const int64_t t = blockIdx.y, s = blockIdx.x, k0 = s * kSlice;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  A xv[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t k = k0 + lane + 32 * i;
    xv[i] = k < K ? x[t * K + k] : A(0);
  }
  A* out = part + (t * gridDim.x + s) * (m + 1);
  for (int r = warp; r <= m; r += kWarps) {
    A acc = 0;
    if (r == m) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc += xv[i] * xv[i];
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int64_t k = k0 + lane + 32 * i;
        if (k < K) acc += fn[int64_t(r) * K + k] * xv[i];
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[r] = acc;
  }
}

// The second, one block per token: the slices' sums in slice order (thread r < m: row r, thread
// m: the squares), the token's mappings by warp 0 (maps_token_warp: the composition's epilogue's
// operations), u = sum_j pre_j X_j (rounded to X's dtype when that is bf16, as mhc_collapse
// stores it) and a = u rstd w, rstd = 1 / sqrt(mean(u^2) + eps) (ops::rmsnorm).
template <int NM, class A>
__global__ void __launch_bounds__(kThreads)
    collapse_norm_finish_kernel(In<A> x, const A* __restrict__ part, int64_t slices, In<A> base,
                                In<A> scale, In<A> w, A* __restrict__ pre, A* __restrict__ post,
                                A* __restrict__ comb, Out<A> a, int n, int64_t D, A norm_eps,
                                A heps, int64_t iters, A rms_eps, bool round_u) {
  __shared__ A red[kWarps];
  __shared__ A mix[(2 + NM) * NM + 1];  // the m projections, then the sum of squares
  __shared__ A spre[NM];
  __shared__ A srstd;
  const int64_t t = blockIdx.x, K = int64_t(n) * D, m = int64_t(2 + n) * n, xb = t * K;
  if (int64_t(threadIdx.x) <= m) {
    A acc = 0;
    // In slice order, unrolled so that the loads can be in flight together (this kernel took
    // 23 us a call on an H100 at batch 64, ncu; these loads one after another are the likely
    // cause, not yet measured apart).
#pragma unroll 8
    for (int64_t s = 0; s < slices; ++s) acc += part[(t * slices + s) * (m + 1) + threadIdx.x];
    mix[threadIdx.x] = acc;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const A inv = A(1) / dsqrt(mix[m] / A(K) + norm_eps);
    maps_token_warp<NM>(mix, inv, base, scale, pre + t * n, post + t * n, spre,
                        comb + t * int64_t(n) * n, n, heps, iters);
  }
  __syncthreads();
  // u, twice: for its sum of squares, then for a (no [D] buffer).
  auto u_at = [&](int64_t e) {
    A s = 0;
    for (int j = 0; j < n; ++j) s += spre[j] * x[xb + int64_t(j) * D + e];
    return round_u ? A(__bfloat162float(__float2bfloat16_rn(float(s)))) : s;
  };
  {
    A v[1] = {A(0)};
    for (int64_t e = threadIdx.x; e < D; e += kThreads) {
      const A u = u_at(e);
      v[0] += u * u;
    }
    const A ss = block_sums<1>(v, red);
    if (threadIdx.x == 0) srstd = A(1) / dsqrt(ss / A(D) + rms_eps);
    __syncthreads();
  }
  const A r = srstd;
  for (int64_t e = threadIdx.x; e < D; e += kThreads) a.set(t * D + e, u_at(e) * r * w[e]);
}

// Per token of the mappings backward: da [T, m] (gradient of h = mix scale + base), dp [T, m]
// (gradient of the projection fn @ flat) and dinv [T] (gradient of inv_rms), as the CPU's
// mappings_bwd token loop.
template <int NM, class A>
__global__ void __launch_bounds__(kTokThreads)
    maps_bwd_token_kernel(In<A> mix, In<A> Lg, In<A> ir, In<A> dpre, In<A> dpost, In<A> dcomb,
                          In<A> base, In<A> scale, A* __restrict__ da, A* __restrict__ dp,
                          A* __restrict__ dinv, A* __restrict__ ws, int64_t T, int n, A heps,
                          int64_t iters) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t m = int64_t(2 + n) * n, nn = int64_t(n) * n;
  const A s0 = scale[0], s1 = scale[1], s2 = scale[2];
  A* at = da + t * m;
  for (int j = 0; j < n; ++j) {
    const A ap = mix[t * m + j] * s0 + base[j];
    at[j] = dpre[t * n + j] * dsigmoid(ap) * dsigmoid(-ap);
    const A aq = mix[t * m + n + j] * s1 + base[n + j];
    at[n + j] = dpost[t * n + j] * A(2) * dsigmoid(aq) * dsigmoid(-aq);
  }
  A* hist = ws;
  A* sums = ws + 2 * iters * nn * T;
  A M[NM * NM];
  load_mat<NM>(M, Lg, t * nn, n);
  sk_forward<NM>(M, n, heps, iters, hist, sums, T, t);
  load_mat<NM>(M, dcomb, t * nn, n);
  sk_backward<NM>(M, n, iters, hist, sums, T, t);
#pragma unroll
  for (int i = 0; i < NM; ++i)
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (i < n && j < n) at[2 * n + i * n + j] = M[i * NM + j];
  // dmix = da * scale_group; dp = dmix * inv_rms; d inv_rms = sum_q dmix_q * (mix_q / inv_rms).
  const A inv = ir[t];
  A di = 0;
  for (int64_t q = 0; q < m; ++q) {
    const A sg = q < n ? s0 : (q < 2 * n ? s1 : s2);
    const A dmix = at[q] * sg;
    dp[t * m + q] = dmix * inv;
    di += dmix * (mix[t * m + q] / inv);
  }
  dinv[t] = di;
}

// dx[t, k] = (-dinv[t] inv[t]^3 / K) x[t, k] (the inv_rms backward, and the first term of the
// mappings' dx).
template <class A>
__global__ void row_scale_kernel(In<A> x, In<A> ir, In<A> dinv, A* __restrict__ dx, int64_t T,
                                 int64_t K) {
  HLM_GRID_STRIDE(i, T * K) {
    const int64_t t = i / K;
    const A r = ir[t];
    const A c = -dinv[t] * r * r * r / A(K);
    dx[i] = c * x[i];
  }
}

// Partial sums over the tokens of part p (in order): part[p, q] = sum_t da[t, q] (q < m) and
// part[p, m + g] = sum_t sum_{q in group g} da[t, q] mix[t, q] (g < 3).
template <class A>
__global__ void param_part_kernel(const A* __restrict__ da, In<A> mix, A* __restrict__ part,
                                  int64_t T, int n) {
  const int m = (2 + n) * n, nq = m + 3;
  const int q = threadIdx.x;
  if (q >= nq) return;
  const int64_t p = blockIdx.x, t0 = p * kTokensPerPart;
  const int64_t t1 = t0 + kTokensPerPart < T ? t0 + kTokensPerPart : T;
  A s = 0;
  if (q < m) {
    for (int64_t t = t0; t < t1; ++t) s += da[t * m + q];
  } else {
    const int g = q - m;
    const int q0 = g == 0 ? 0 : (g == 1 ? n : 2 * n), q1 = g == 0 ? n : (g == 1 ? 2 * n : m);
    for (int64_t t = t0; t < t1; ++t)
      for (int qq = q0; qq < q1; ++qq) s += da[t * m + qq] * mix[t * m + qq];
  }
  part[p * nq + q] = s;
}

// dbase[q] += sum_p part[p, q]; dscale[g] += sum_p part[p, m + g] (the parts in order; the
// addition to the accumulator in f64, rounded once).
template <class A>
__global__ void param_reduce_kernel(const A* __restrict__ part, int64_t parts, int m,
                                    In<double> db_old, Out<double> db, In<double> ds_old,
                                    Out<double> ds) {
  const int nq = m + 3;
  const int q = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= nq) return;
  A s = 0;
  for (int64_t p = 0; p < parts; ++p) s += part[p * nq + q];
  if (q < m) {
    db.set(q, db_old[q] + double(s));
  } else {
    ds.set(q - m, ds_old[q - m] + double(s));
  }
}

// acc[i] += g[i], in f64, rounded once to acc's dtype.
__global__ void acc_add_kernel(In<double> g, In<double> acc_old, Out<double> acc, int64_t N) {
  HLM_GRID_STRIDE(i, N) {
    acc.set(i, acc_old[i] + g[i]);
  }
}

// ---- collapse / write-back
// -----------------------------------------------------------------------

// u[t, e] = sum_j pre[t, j] x[t, j, e].
template <class A>
__global__ void collapse_kernel(In<A> x, In<A> pre, Out<A> u, int64_t T, int64_t n, int64_t D) {
  HLM_GRID_STRIDE(i, T * D) {
    const int64_t t = i / D, e = i % D;
    A s = 0;
    for (int64_t j = 0; j < n; ++j) s += pre[t * n + j] * x[(t * n + j) * D + e];
    u.set(i, s);
  }
}

// One block per token: dx[t, j, e] = pre[t, j] du[t, e]; dpre[t, j] = sum_e du[t, e] x[t, j, e].
template <int NM, class A>
__global__ void __launch_bounds__(kThreads)
    collapse_bwd_kernel(In<A> x, In<A> pre, In<A> du, A* __restrict__ dx, A* __restrict__ dpre,
                        int n, int64_t D) {
  __shared__ A red[kWarps * NM];
  const int64_t t = blockIdx.x;
  A pr[NM], acc[NM];
#pragma unroll
  for (int j = 0; j < NM; ++j) {
    pr[j] = j < n ? pre[t * n + j] : A(0);
    acc[j] = 0;
  }
  for (int64_t e = threadIdx.x; e < D; e += kThreads) {
    const A g = du[t * D + e];
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (j < n) {
        const int64_t k = (t * n + j) * D + e;
        acc[j] += g * x[k];
        dx[k] = pr[j] * g;
      }
  }
  const A s = block_sums<NM>(acc, red);
  if (int(threadIdx.x) < n) dpre[t * n + threadIdx.x] = s;
}

// X'[t, i, e] = post[t, i] y[t, e] + sum_j comb[t, j, i] x[t, j, e]; one thread per (t, e).
template <class A>
__global__ void write_back_kernel(In<A> x, In<A> y, In<A> post, In<A> comb, Out<A> out, int64_t T,
                                  int64_t n, int64_t D) {
  HLM_GRID_STRIDE(idx, T * D) {
    const int64_t t = idx / D, e = idx % D;
    const A yv = y[idx];
    for (int64_t i = 0; i < n; ++i) {
      A s = post[t * n + i] * yv;
      for (int64_t j = 0; j < n; ++j) s += comb[(t * n + j) * n + i] * x[(t * n + j) * D + e];
      out.set((t * n + i) * D + e, s);
    }
  }
}

// One block per token, g = dX'[t]: dy[e] = sum_i post_i g_i[e]; dx_j[e] = sum_i comb[j][i] g_i[e];
// dpost_i = <g_i, y>; dcomb[j][i] = <g_i, x_j>.
template <int NM, class A>
__global__ void __launch_bounds__(kThreads)
    write_back_bwd_kernel(In<A> x, In<A> y, In<A> post, In<A> comb, In<A> g, A* __restrict__ dx,
                          A* __restrict__ dy, A* __restrict__ dpost, A* __restrict__ dcomb, int n,
                          int64_t D) {
  constexpr int V = NM + NM * NM;
  __shared__ A red[kWarps * V];
  const int64_t t = blockIdx.x;
  A po[NM], cb[NM * NM], acc[V];
#pragma unroll
  for (int i = 0; i < NM; ++i) po[i] = i < n ? post[t * n + i] : A(0);
#pragma unroll
  for (int j = 0; j < NM; ++j)
#pragma unroll
    for (int i = 0; i < NM; ++i)
      cb[j * NM + i] = (i < n && j < n) ? comb[(t * n + j) * n + i] : A(0);
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0;
  for (int64_t e = threadIdx.x; e < D; e += kThreads) {
    A gv[NM];
#pragma unroll
    for (int i = 0; i < NM; ++i) gv[i] = i < n ? g[(t * n + i) * D + e] : A(0);
    A s = 0;
#pragma unroll
    for (int i = 0; i < NM; ++i)
      if (i < n) s += po[i] * gv[i];
    dy[t * D + e] = s;
    const A yv = y[t * D + e];
#pragma unroll
    for (int i = 0; i < NM; ++i)
      if (i < n) acc[i] += gv[i] * yv;
#pragma unroll
    for (int j = 0; j < NM; ++j) {
      if (j < n) {
        const A xv = x[(t * n + j) * D + e];
        A d = 0;
#pragma unroll
        for (int i = 0; i < NM; ++i)
          if (i < n) {
            d += cb[j * NM + i] * gv[i];
            acc[NM + j * NM + i] += gv[i] * xv;
          }
        dx[(t * n + j) * D + e] = d;
      }
    }
  }
  const A s = block_sums<V>(acc, red);
  const int k = threadIdx.x;
  if (k < NM) {
    if (k < n) dpost[t * n + k] = s;
  } else if (k < V) {
    const int j = (k - NM) / NM, i = (k - NM) % NM;
    if (i < n && j < n) dcomb[(t * n + j) * n + i] = s;
  }
}

// ---- model level
// ---------------------------------------------------------------------------------

// out[t, j, e] = e[t, e].
template <class A>
__global__ void expand_kernel(In<A> src, Out<A> out, int64_t T, int64_t n, int64_t D) {
  HLM_GRID_STRIDE(i, T * n * D) {
    const int64_t e = i % D, t = i / (n * D);
    out.set(i, src[t * D + e]);
  }
}

// out[t, e] = (sum_j x[t, j, e]) * scale.
template <class A>
__global__ void stream_sum_kernel(In<A> x, Out<A> out, int64_t T, int64_t n, int64_t D, A scale) {
  HLM_GRID_STRIDE(i, T * D) {
    const int64_t t = i / D, e = i % D;
    A s = 0;
    for (int64_t j = 0; j < n; ++j) s += x[(t * n + j) * D + e];
    out.set(i, s * scale);
  }
}

// dx[t, j, e] = dh[t, e] / n.
template <class A>
__global__ void mean_bwd_kernel(In<A> dh, Out<A> dx, int64_t T, int64_t n, int64_t D) {
  HLM_GRID_STRIDE(i, T * n * D) {
    const int64_t e = i % D, t = i / (n * D);
    dx.set(i, dh[t * D + e] / A(n));
  }
}

// dy[t, e] = sum_i post[t, i] g[t, i, e].
template <class A>
__global__ void post_sum_kernel(In<A> post, In<A> g, A* __restrict__ dy, int64_t T, int64_t n,
                                int64_t D) {
  HLM_GRID_STRIDE(idx, T * D) {
    const int64_t t = idx / D, e = idx % D;
    A s = 0;
    for (int64_t i = 0; i < n; ++i) s += post[t * n + i] * g[(t * n + i) * D + e];
    dy[idx] = s;
  }
}

template <class A>
__global__ void add3_kernel(A* __restrict__ a, const A* __restrict__ b, const A* __restrict__ c,
                            int64_t N) {
  HLM_GRID_STRIDE(i, N) {
    a[i] = (a[i] + b[i]) + c[i];
  }
}

#undef HLM_GRID_STRIDE

}  // namespace

// ---- launchers
// -----------------------------------------------------------------------------------

void mhc_inv_rms(const Tensor& x_, double eps, Tensor& inv_rms) {
  const int64_t T = x_.size(0), K = x_.size(1) * x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_);
  dispatch_acc(inv_rms.dtype(), [&](auto tag) {
    using A = decltype(tag);
    inv_rms_kernel<A><<<unsigned(T), kThreads>>>(in_of<A>(x), mptr<A>(inv_rms), K, A(eps));
  });
  check_launch("mhc_inv_rms");
}

void mhc_inv_rms_backward(const Tensor& x_, const Tensor& inv_rms_, const Tensor& d_inv_rms_,
                          Tensor& dx) {
  const int64_t T = x_.size(0), K = x_.size(1) * x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_), ir = cont(inv_rms_), di = cont(d_inv_rms_);
  dispatch_acc(dx.dtype(), [&](auto tag) {
    using A = decltype(tag);
    row_scale_kernel<A>
        <<<grid_for(T * K), kThreads>>>(in_of<A>(x), in_of<A>(ir), in_of<A>(di), mptr<A>(dx), T, K);
  });
  check_launch("mhc_inv_rms_backward");
}

void mhc_sinkhorn(const Tensor& logits_, double hc_eps, int64_t iters, Tensor& comb) {
  const int64_t T = logits_.size(0), n = logits_.size(1);
  if (T == 0) return;
  const Tensor L = cont(logits_);
  dispatch_acc(comb.dtype(), [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      sinkhorn_fwd_kernel<NM, A><<<blocks_for(T, kTokThreads), kTokThreads>>>(
          in_of<A>(L), mptr<A>(comb), T, int(n), A(hc_eps), iters);
    });
  });
  check_launch("mhc_sinkhorn");
}

void mhc_sinkhorn_backward(const Tensor& logits_, const Tensor& dcomb_, double hc_eps,
                           int64_t iters, Tensor& dlogits) {
  const int64_t T = logits_.size(0), n = logits_.size(1);
  if (T == 0) return;
  const Tensor L = cont(logits_), dc = cont(dcomb_);
  const Tensor ws = alloc({sk_ws_rows(n, iters), T}, dlogits.dtype());
  dispatch_acc(dlogits.dtype(), [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      sinkhorn_bwd_kernel<NM, A><<<blocks_for(T, kTokThreads), kTokThreads>>>(
          in_of<A>(L), in_of<A>(dc), mptr<A>(dlogits), mptr<A>(ws), T, int(n), A(hc_eps), iters);
    });
  });
  check_launch("mhc_sinkhorn_backward");
}

void mhc_mappings_forward(const Tensor& x_, const MhcParams& p, const MhcConfig& c,
                          MhcMappings& m) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2), K = n * D;
  if (T == 0) return;
  const DType dt = m.mix.dtype();
  const Tensor x = cont(ops::as_dtype(x_, dt)), fn = cont(ops::as_dtype(p.fn, dt));
  const Tensor base = cont(p.base), scale = cont(p.scale);
  dispatch_acc(dt, [&](auto tag) {
    using A = decltype(tag);
    inv_rms_kernel<A><<<unsigned(T), kThreads>>>(in_of<A>(x), mptr<A>(m.inv_rms), K, A(c.norm_eps));
    check_launch("mhc_mappings_forward (inv_rms)");
  });
  // mix = flat @ fn^T (the projection; scaled by inv_rms in the epilogue).
  ops::gemm(x.view({T, K}), false, fn, true, m.mix);
  dispatch_acc(dt, [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      maps_epilogue_kernel<NM, A><<<blocks_for(T, kTokThreads), kTokThreads>>>(
          mptr<A>(m.mix), mptr<A>(m.inv_rms), in_of<A>(base), in_of<A>(scale), mptr<A>(m.pre),
          mptr<A>(m.post), mptr<A>(m.comb_logits), mptr<A>(m.comb), T, int(n), A(c.hc_eps),
          c.sinkhorn_iters);
    });
  });
  check_launch("mhc_mappings_forward");
}

void mhc_mappings_backward(const Tensor& x_, const MhcParams& p, const MhcConfig& c,
                           const MhcMappings& mp, const Tensor& dpre_, const Tensor& dpost_,
                           const Tensor& dcomb_, MhcParamGrads& g, Tensor& dx) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2), K = n * D, m = c.n_mix();
  if (T == 0) return;
  const DType dt = dx.dtype();
  const Tensor x = cont(ops::as_dtype(x_, dt)), fn = cont(ops::as_dtype(p.fn, dt));
  const Tensor base = cont(p.base), scale = cont(p.scale);
  const Tensor mix = cont(mp.mix), Lg = cont(mp.comb_logits), ir = cont(mp.inv_rms);
  const Tensor dpre = cont(dpre_), dpost = cont(dpost_), dcomb = cont(dcomb_);
  const Tensor da = alloc({T, m}, dt), dp = alloc({T, m}, dt), dinv = alloc({T}, dt);
  const Tensor ws = alloc({sk_ws_rows(n, c.sinkhorn_iters), T}, dt);
  const int64_t parts = (T + kTokensPerPart - 1) / kTokensPerPart;
  const Tensor part = alloc({parts, m + 3}, dt);
  dispatch_acc(dt, [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      maps_bwd_token_kernel<NM, A><<<blocks_for(T, kTokThreads), kTokThreads>>>(
          in_of<A>(mix), in_of<A>(Lg), in_of<A>(ir), in_of<A>(dpre), in_of<A>(dpost),
          in_of<A>(dcomb), in_of<A>(base), in_of<A>(scale), mptr<A>(da), mptr<A>(dp), mptr<A>(dinv),
          mptr<A>(ws), T, int(n), A(c.hc_eps), c.sinkhorn_iters);
    });
    check_launch("mhc_mappings_backward (tokens)");
    row_scale_kernel<A><<<grid_for(T * K), kThreads>>>(in_of<A>(x), in_of<A>(ir), in_of<A>(dinv),
                                                       mptr<A>(dx), T, K);
    check_launch("mhc_mappings_backward (inv_rms)");
    param_part_kernel<A><<<unsigned(parts), unsigned((m + 3 + 31) / 32 * 32)>>>(
        mptr<A>(da), in_of<A>(mix), mptr<A>(part), T, int(n));
    check_launch("mhc_mappings_backward (d base, d scale parts)");
    param_reduce_kernel<A><<<1, unsigned((m + 3 + 31) / 32 * 32)>>>(
        mptr<A>(part), parts, int(m), in_of<double>(g.dbase), out_of<double>(g.dbase),
        in_of<double>(g.dscale), out_of<double>(g.dscale));
    check_launch("mhc_mappings_backward (d base, d scale)");
  });
  // dx += dp @ fn (the path through mix), after dx = the inv_rms path.
  Tensor dxv = dx.view({T, K});
  ops::gemm(dp, false, fn, false, dxv, 1.0, 1.0);
  // d fn += dp^T flat.
  Tensor dfn = alloc({m, K}, dt);
  ops::gemm(dp, true, x.view({T, K}), false, dfn);
  acc_add_kernel<<<grid_for(m * K), kThreads>>>(in_of<double>(dfn), in_of<double>(g.dfn),
                                                out_of<double>(g.dfn), m * K);
  check_launch("mhc_mappings_backward (d fn)");
}

void mhc_collapse_norm(const Tensor& x_, const MhcParams& p, const MhcConfig& c,
                       const Tensor& norm_w, double norm_eps, MhcCollapseNormed& r) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2), K = n * D, m = c.n_mix();
  if (T == 0) return;
  HLM_CHECK(T <= kMaxBlocks, "mhc_collapse_norm on CUDA: {} tokens, at most {}", T, kMaxBlocks);
  const Tensor x = cont(x_), fn = cont(p.fn), base = cont(p.base), scale = cont(p.scale),
               w = cont(norm_w);
  const int64_t slices = (K + kSlice - 1) / kSlice;
  const DType cd = compute_dtype(x.dtype());
  const Tensor part = alloc({T, slices, m + 1}, cd);
  dispatch_acc(cd, [&](auto tag) {
    using A = decltype(tag);
    collapse_norm_part_kernel<A><<<dim3(unsigned(slices), unsigned(T)), kThreads>>>(
        in_of<A>(x), in_of<A>(fn), mptr<A>(part), int(m), K);
    check_launch("mhc_collapse_norm (projection slices)");
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      collapse_norm_finish_kernel<NM, A><<<unsigned(T), kThreads>>>(
          in_of<A>(x), mptr<A>(part), slices, in_of<A>(base), in_of<A>(scale), in_of<A>(w),
          mptr<A>(r.pre), mptr<A>(r.post), mptr<A>(r.comb), out_of<A>(r.a), int(n), D,
          A(c.norm_eps), A(c.hc_eps), c.sinkhorn_iters, A(norm_eps), x.dtype() == DType::bf16);
    });
  });
  check_launch("mhc_collapse_norm");
}

void mhc_collapse(const Tensor& x_, const Tensor& pre_, Tensor& u) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_), pre = cont(pre_);
  dispatch_acc(compute_dtype(x.dtype()), [&](auto tag) {
    using A = decltype(tag);
    collapse_kernel<A>
        <<<grid_for(T * D), kThreads>>>(in_of<A>(x), in_of<A>(pre), out_of<A>(u), T, n, D);
  });
  check_launch("mhc_collapse");
}

void mhc_collapse_backward(const Tensor& x_, const Tensor& pre_, const Tensor& du_,
                           MhcCollapseGrads& r) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_), pre = cont(pre_), du = cont(du_);
  dispatch_acc(r.dx.dtype(), [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      collapse_bwd_kernel<NM, A><<<unsigned(T), kThreads>>>(
          in_of<A>(x), in_of<A>(pre), in_of<A>(du), mptr<A>(r.dx), mptr<A>(r.dpre), int(n), D);
    });
  });
  check_launch("mhc_collapse_backward");
}

void mhc_write_back(const Tensor& x_, const Tensor& y_, const Tensor& post_, const Tensor& comb_,
                    Tensor& out) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_), y = cont(y_), post = cont(post_), comb = cont(comb_);
  dispatch_acc(compute_dtype(x.dtype()), [&](auto tag) {
    using A = decltype(tag);
    write_back_kernel<A><<<grid_for(T * D), kThreads>>>(in_of<A>(x), in_of<A>(y), in_of<A>(post),
                                                        in_of<A>(comb), out_of<A>(out), T, n, D);
  });
  check_launch("mhc_write_back");
}

void mhc_write_back_backward(const Tensor& x_, const Tensor& y_, const Tensor& post_,
                             const Tensor& comb_, const Tensor& dx_out_, MhcWriteBackGrads& r) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_), y = cont(y_), post = cont(post_), comb = cont(comb_),
               g = cont(dx_out_);
  dispatch_acc(r.dx.dtype(), [&](auto tag) {
    using A = decltype(tag);
    dispatch_nm(n, [&](auto nm) {
      constexpr int NM = decltype(nm)::value;
      write_back_bwd_kernel<NM, A><<<unsigned(T), kThreads>>>(
          in_of<A>(x), in_of<A>(y), in_of<A>(post), in_of<A>(comb), in_of<A>(g), mptr<A>(r.dx),
          mptr<A>(r.dy), mptr<A>(r.dpost), mptr<A>(r.dcomb), int(n), D);
    });
  });
  check_launch("mhc_write_back_backward");
}

void mhc_expand(const Tensor& e_, Tensor& out) {
  const int64_t T = out.size(0), n = out.size(1), D = out.size(2);
  if (T == 0) return;
  const Tensor e = cont(e_);
  dispatch_acc(compute_dtype(e.dtype()), [&](auto tag) {
    using A = decltype(tag);
    expand_kernel<A><<<grid_for(T * n * D), kThreads>>>(in_of<A>(e), out_of<A>(out), T, n, D);
  });
  check_launch("mhc_expand");
}

void mhc_stream_sum(const Tensor& x_, int64_t divisor, Tensor& out) {
  const int64_t T = x_.size(0), n = x_.size(1), D = x_.size(2);
  if (T == 0) return;
  const Tensor x = cont(x_);
  dispatch_acc(compute_dtype(x.dtype()), [&](auto tag) {
    using A = decltype(tag);
    stream_sum_kernel<A>
        <<<grid_for(T * D), kThreads>>>(in_of<A>(x), out_of<A>(out), T, n, D, A(1) / A(divisor));
  });
  check_launch("mhc_stream_sum");
}

void mhc_mean_contract_backward(const Tensor& dh_, Tensor& dx) {
  const int64_t T = dx.size(0), n = dx.size(1), D = dx.size(2);
  if (T == 0) return;
  const Tensor dh = cont(dh_);
  dispatch_acc(compute_dtype(dh.dtype()), [&](auto tag) {
    using A = decltype(tag);
    mean_bwd_kernel<A><<<grid_for(T * n * D), kThreads>>>(in_of<A>(dh), out_of<A>(dx), T, n, D);
  });
  check_launch("mhc_mean_contract_backward");
}

void mhc_post_sum(const Tensor& post_, const Tensor& dx_out_, Tensor& dy) {
  const int64_t T = dx_out_.size(0), n = dx_out_.size(1), D = dx_out_.size(2);
  if (T == 0) return;
  const Tensor post = cont(post_), g = cont(dx_out_);
  dispatch_acc(dy.dtype(), [&](auto tag) {
    using A = decltype(tag);
    post_sum_kernel<A>
        <<<grid_for(T * D), kThreads>>>(in_of<A>(post), in_of<A>(g), mptr<A>(dy), T, n, D);
  });
  check_launch("mhc_post_sum");
}

void mhc_add3_(Tensor& dx, const Tensor& b, const Tensor& c) {
  const int64_t N = dx.numel();
  if (N == 0) return;
  dispatch_acc(dx.dtype(), [&](auto tag) {
    using A = decltype(tag);
    add3_kernel<A><<<grid_for(N), kThreads>>>(mptr<A>(dx), cptr<A>(b), cptr<A>(c), N);
  });
  check_launch("mhc_add3_");
}

}  // namespace hlm::ops::cuda
