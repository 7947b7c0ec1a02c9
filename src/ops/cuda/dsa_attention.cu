// The sparse and the dense causal MLA attention (ops/dsa_sparse_attention.h) and the indexer
// loss's attention target (ops/dsa_indexer_loss.h) on CUDA (ops/cuda/dsa_attention.cuh), the math
// of ops/cpu/dsa_sparse_attention.cpp and ops/cpu/dsa_indexer_loss.cpp (target_rows). MQA /
// absorbed MLA: one latent row kv[s] in R^D (D = D_qk) is the key of every head, its first d_v
// channels the value. Query t visits its keys S_t in slot order; l_j = scale q[t,h] . kv[S_tj] (a
// chain of FMAs in channel order). Every kernel is templated on its key source (dsa_keys.cuh;
// PatternKeys: an explicit pattern and its inverse map, built on the device by
// device_rows_pattern; DenseKeys: the causal set doc_start[t] .. t of t's document, whose readers
// of key s are the queries s .. doc_end[s]-1, from upload_layout, so causal_attention needs no
// O(T^2) pattern). Both visit keys and readers in the same order,
// so causal_attention gives the bits of sparse_attention with every causal token ascending.
// Storage f32 / f64 / bf16; arithmetic in f32 (f64 for f64); lse, Delta and targets in that
// computation dtype. Every sum below runs in an order fixed by the shapes alone (never by the
// launch or by timing), with no atomics, so every result is bit-identical run to run.
//
// Query-side kernels (forward, dq, target): a block of kThreads = 256 threads (8 warps) serves one
// query t and a group of HG heads (HG = 4 for H <= 4, else 16; the heads of one query sit in
// consecutive blocks, so their key rows are read from L2). The block keeps the group's q rows in
// shared memory (converted to the computation dtype, zero-padded to whole 16-byte packs) and walks
// S_t in tiles of kt <= 32 keys (32, or fewer where shared memory is short: large D_qk in f64),
// each tile loaded once into shared memory for all the group's heads (rows of an odd number of
// packs: conflict-free 16-byte reads). Score phase: lane j of warp w computes l for key j of the
// tile and heads w, w + 8, ... (16-byte reads of the key row and of the broadcast q rows); a warp
// owns whole heads, so a head's tile max / sum is a warp butterfly. Value phase: a thread owns
// channels c = tid + 256 k (k < CPT) of every head of the group, accumulated in registers over the
// tile's keys in order; channels beyond 256 CPT (CPT <= 4) go to further blocks (grid y), which
// recompute the scores.
//   forward: online softmax: per tile m' = max(m, max_j l_j), alpha = exp(m - m'),
//            p_j = exp(l_j - m'), sum = sum alpha + sum_j p_j (warp butterfly),
//            acc = acc alpha + sum_j p_j v_j; at the end out = acc / sum, lse = m + log sum
//            (empty row: out 0, lse -inf). The target's lse comes from the same kernel with
//            d_v = 0.
//   dq:      Delta[t,h] = dout . out first (one warp per row, butterfly); per tile
//            p_j = exp(l_j - lse), ds_j = p_j (dout . v_j - Delta), acc += ds_j k_j;
//            dq = scale acc.
//   target:  one block per query walks all head groups: e_hj = exp(l_hj - lse_h); the thread of
//            key j adds e_hj over the heads in order into its slot of the output row (which the
//            block owns), then the row total (thread partials, butterfly, the 8 warp sums in
//            order) divides the row. The row is zeroed first (0 outside the set). The dense
//            variant derives S_t = doc_start[t] .. t (slot = key - doc_start) on the device
//            from upload_layout; the explicit one reads the checked pattern.
// dkv (key side): one block per key s (channel chunks in grid y) gathers over its readers (the
// inverse map's entries in increasing (t, slot) order, or the dense causal readers
// s .. doc_end[s]-1), flattened to (reader, head) pairs in (reader, head) order. Per step of 32
// pairs each warp recomputes 4 pairs (lanes over channels, butterfly):
// p = exp(scale q[t,h] . k_s - lse), ds = p (dout[t,h] . v_s - Delta); then every thread adds,
// pair by pair in order, ds q[t,h][c] and p dout[t,h][c] to its channels' registers;
// dkv[s] = (sum p dout ; 0) + scale sum ds q. Workspace: Delta [T, H] only, no [E, H] buffer.
//
// Cost: the query side reads each selected key row once per head group (4 times for 64 heads)
// and does D_qk + d_v FMAs per (entry, head) in the forward on CUDA cores. The key side (dkv)
// reads the q and dout rows of every (reader, head) pair of a key: E H (D_qk + d_v) elements in
// all, about 30 times what the query side reads at H = 64, D_qk = 576, d_v = 512; the readers of
// neighbouring keys overlap in time (all blocks walk their readers in increasing t), which is what
// L2 can catch.
// What would make it faster: mma.sync (TF32 / BF16) for the score and value products of a tile
// (a 16-head x 32-key x D product is one warp-level MMA sequence); keeping bf16 tiles in shared
// memory and double-buffering them with cp.async; larger head groups (all 64 heads of a query in
// one block, so every key row is read once per query); for dkv, a bounded workspace of per-entry
// contributions sum_h (scale ds q[t,h] ; p dout[t,h]) [entries of a chunk of queries, D_qk],
// computed on the query side (one q row load per query instead of one per (key, reader)) and
// gathered per key, chunk after chunk, in order.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "ops/cuda/dsa_attention.cuh"
#include "ops/cuda/dsa_attention_mma.cuh"
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_keys.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;   // most keys per tile: one per lane
constexpr int kPairs = 32;  // (reader, head) pairs per dkv step: kPairs / kWarps per warp

template <class A>
__device__ __forceinline__ A neg_inf() {
  return A(-INFINITY);
}
__device__ __forceinline__ float dlog(float x) {
  return logf(x);
}
__device__ __forceinline__ double dlog(double x) {
  return log(x);
}

template <class A>
__device__ __forceinline__ A max_of(A a, A b) {
  return b > a ? b : a;
}

// acc[h][k] += w[h kTile + j] * row_j[c + 256 k] over the tile's keys j in order (row j at
// ks + j kstride; channels at or past lim read as 0): the value (p v) and dq (ds k) products.
template <int HG, int CPT, class A>
__device__ __forceinline__ void tile_accumulate(A (&acc)[HG][CPT], const A* w, const A* ks,
                                                int kstride, int nj, int c, int lim) {
  for (int j = 0; j < nj; ++j) {
    A v[CPT];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int ck = c + kThreads * k;
      v[k] = ck < lim ? ks[j * kstride + ck] : A(0);
    }
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      const A p = w[h * kTile + j];
#pragma unroll
      for (int k = 0; k < CPT; ++k) acc[h][k] = dfma(p, v[k], acc[h][k]);
    }
  }
}

// Heads per warp in the score phase (HG < 8: warps w >= HG idle there).
template <int HG>
constexpr int heads_per_warp() {
  static_assert(HG < kWarps || HG % kWarps == 0, "head group: fewer than 8 or a multiple of 8");
  return (HG + kWarps - 1) / kWarps;
}

// Shared-memory rows hold the channels in the computation dtype, zero-padded to a multiple of
// V = 16 bytes / sizeof(A) (4 floats, 2 doubles), so the score dots read 16-byte packs. A pack of
// zeros adds +0 to a dot: the padded chain of FMAs gives the unpadded result.
template <class A>
constexpr int vec_of() {
  return int(16 / sizeof(A));
}
template <class A>
__host__ __device__ __forceinline__ int padded(int n) {
  return (n + vec_of<A>() - 1) / vec_of<A>() * vec_of<A>();
}
// Row stride of a key tile: an odd number of packs, so that the lanes reading one pack of 8
// different rows (a quarter warp, one 16-byte access each) hit 8 different groups of banks.
template <class A>
__host__ __device__ __forceinline__ int key_stride(int D) {
  return vec_of<A>() * ((padded<A>(D) / vec_of<A>()) | 1);
}

// Rows [nrows, stride] of a head group: dst[h, c] = src[base + h * len + c] for h < nvalid and
// c < len, 0 elsewhere (the whole block).
template <class A, class T>
__device__ __forceinline__ void load_rows(const T* src, int64_t base, int nvalid, int nrows,
                                          int len, int stride, A* dst) {
  for (int i = threadIdx.x; i < nrows * stride; i += kThreads) {
    const int h = i / stride, c = i - h * stride;
    dst[i] = h < nvalid && c < len ? ld<A>(src, base + int64_t(h) * len + c) : A(0);
  }
}

// Rows S_t[j0 .. j0 + nj) of kv into the tile ks [nj, key_stride], padded (the whole block).
template <class A, class T, class Keys>
__device__ __forceinline__ void load_key_tile(const T* kv, const Keys& keys, int64_t f, int64_t j0,
                                              int nj, int D, A* ks) {
  const int DP = padded<A>(D), kstride = key_stride<A>(D);
  for (int i = threadIdx.x; i < nj * DP; i += kThreads) {
    const int j = i / DP, c = i - j * DP;
    ks[j * kstride + c] = c < D ? ld<A>(kv, keys.key_at(f, j0 + j) * D + c) : A(0);
  }
}

// dot[i] += qs[warp + 8 i] . kr over channels [c0, c1) (multiples of V; qs rows of stride qstride),
// a chain of FMAs in channel order.
template <int HPW, class A>
__device__ __forceinline__ void key_dots(const A* qs, int qstride, const A* kr, int c0, int c1,
                                         int warp, A (&dot)[HPW]) {
  constexpr int V = vec_of<A>();
  for (int c = c0; c < c1; c += V) {
    const Pack<A, V> k = *reinterpret_cast<const Pack<A, V>*>(kr + c);
#pragma unroll
    for (int i = 0; i < HPW; ++i) {
      const Pack<A, V> qv =
          *reinterpret_cast<const Pack<A, V>*>(qs + (warp + kWarps * i) * qstride + c);
#pragma unroll
      for (int u = 0; u < V; ++u) dot[i] = dfma(qv.v[u], k.v[u], dot[i]);
    }
  }
}

// ---- forward (and the target's lse: dv = 0, out = nullptr) ----------------------------------

// Shared memory (computation dtype): q [HG, padded D], key tile [kt, stride], p [HG, 32], alpha,
// final sum and max [HG] each.
template <class A>
size_t fwd_smem(int hg, int kt, int D, int) {
  return sizeof(A) * size_t(hg * padded<A>(D) + kt * key_stride<A>(D) + hg * kTile + 3 * hg);
}

template <class T, int HG, int CPT, class Keys>
__global__ void __launch_bounds__(kThreads)
    attn_fwd_kernel(const T* __restrict__ q, const T* __restrict__ kv, Keys keys,
                    T* __restrict__ out, acc_t<T>* __restrict__ lse, int H, int D, int dv, int kt,
                    acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int HPW = heads_per_warp<HG>();
  extern __shared__ float4 smem4[];
  const int DP = padded<A>(D), kstride = key_stride<A>(D);
  A* qs = reinterpret_cast<A*>(smem4);
  A* ks = qs + HG * DP;
  A* ps = ks + kt * kstride;
  A* al = ps + HG * kTile;
  A* fsum = al + HG;
  A* fmax = fsum + HG;
  const int ngroups = (H + HG - 1) / HG;
  const int64_t t = blockIdx.x / ngroups;
  const int h0 = int(blockIdx.x % ngroups) * HG, hv = H - h0 < HG ? H - h0 : HG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = int(blockIdx.y) * kThreads * CPT;
  const int64_t f = keys.first(t), n = keys.count(t);
  load_rows(q, (t * H + h0) * D, hv, HG, D, DP, qs);
  A m[HPW], sum[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) m[i] = neg_inf<A>(), sum[i] = A(0);
  A acc[HG][CPT];
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int k = 0; k < CPT; ++k) acc[h][k] = A(0);
  for (int64_t j0 = 0; j0 < n; j0 += kt) {
    const int nj = int(n - j0 < kt ? n - j0 : kt);
    __syncthreads();  // the previous tile's keys and p are no longer read (and q is in place)
    load_key_tile(kv, keys, f, j0, nj, D, ks);
    __syncthreads();
    if (warp < HG) {
      A dot[HPW] = {};
      key_dots<HPW>(qs, DP, ks + (lane < nj ? lane : 0) * kstride, 0, DP, warp, dot);
#pragma unroll
      for (int i = 0; i < HPW; ++i) {
        const int h = warp + kWarps * i;
        const A l = lane < nj ? scale * dot[i] : neg_inf<A>();
        const A mn = max_of(m[i], warp_max(l));
        const A p = lane < nj ? dexp(l - mn) : A(0);
        const A a = m[i] == mn ? A(1) : dexp(m[i] - mn);
        sum[i] = sum[i] * a + warp_sum(p);
        m[i] = mn;
        ps[h * kTile + lane] = p;
        if (lane == 0) al[h] = a;
      }
    }
    __syncthreads();
    if (c0 < dv) {
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        const A a = al[h];
#pragma unroll
        for (int k = 0; k < CPT; ++k) acc[h][k] *= a;
      }
      tile_accumulate<HG, CPT>(acc, ps, ks, kstride, nj, c0 + tid, dv);
    }
  }
  if (warp < HG && lane == 0)
#pragma unroll
    for (int i = 0; i < HPW; ++i) {
      fsum[warp + kWarps * i] = sum[i];
      fmax[warp + kWarps * i] = m[i];
    }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    if (h >= hv) break;
    const A s = fsum[h];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int c = c0 + tid + kThreads * k;
      if (c < dv) st(out, (t * H + h0 + h) * dv + c, s > A(0) ? acc[h][k] / s : A(0));
    }
  }
  if (blockIdx.y == 0 && tid < hv)
    lse[t * H + h0 + tid] = fsum[tid] > A(0) ? fmax[tid] + dlog(fsum[tid]) : neg_inf<A>();
}

// ---- backward -----------------------------------------------------------------------------------

// Delta[r] = dout[r] . out[r] for the rows r of [T * H, dv]: one warp per row.
template <class T>
__global__ void __launch_bounds__(kThreads)
    attn_delta_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                      acc_t<T>* __restrict__ delta, int64_t rows, int dv) {
  using A = acc_t<T>;
  const int64_t r = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= rows) return;  // whole warps
  const int lane = threadIdx.x & 31;
  A s = 0;
  for (int c = lane; c < dv; c += 32) s = dfma(ld<A>(dout, r * dv + c), ld<A>(out, r * dv + c), s);
  s = warp_sum(s);
  if (lane == 0) delta[r] = s;
}

// Shared memory: q [HG, padded D], dout [HG, padded dv], key tile [kt, stride], ds [HG, 32].
template <class A>
size_t dq_smem(int hg, int kt, int D, int dv) {
  return sizeof(A) *
         size_t(hg * (padded<A>(D) + padded<A>(dv)) + kt * key_stride<A>(D) + hg * kTile);
}

template <class T, int HG, int CPT, class Keys>
__global__ void __launch_bounds__(kThreads)
    attn_dq_kernel(const T* __restrict__ q, const T* __restrict__ kv, const T* __restrict__ dout,
                   const acc_t<T>* __restrict__ lse, const acc_t<T>* __restrict__ delta, Keys keys,
                   T* __restrict__ dq, int H, int D, int dv, int kt, acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int HPW = heads_per_warp<HG>();
  extern __shared__ float4 smem4[];
  const int DP = padded<A>(D), dvP = padded<A>(dv), kstride = key_stride<A>(D);
  A* qs = reinterpret_cast<A*>(smem4);
  A* dos = qs + HG * DP;
  A* ks = dos + HG * dvP;
  A* ps = ks + kt * kstride;
  const int ngroups = (H + HG - 1) / HG;
  const int64_t t = blockIdx.x / ngroups;
  const int h0 = int(blockIdx.x % ngroups) * HG, hv = H - h0 < HG ? H - h0 : HG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = int(blockIdx.y) * kThreads * CPT;
  const int64_t f = keys.first(t), n = keys.count(t);
  load_rows(q, (t * H + h0) * D, hv, HG, D, DP, qs);
  load_rows(dout, (t * H + h0) * dv, hv, HG, dv, dvP, dos);
  A L[HPW], Dl[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    const int h = warp + kWarps * i;
    const bool live = h < hv;
    L[i] = live ? lse[t * H + h0 + h] : A(0);
    Dl[i] = live ? delta[t * H + h0 + h] : A(0);
  }
  A acc[HG][CPT];
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int k = 0; k < CPT; ++k) acc[h][k] = A(0);
  for (int64_t j0 = 0; j0 < n; j0 += kt) {
    const int nj = int(n - j0 < kt ? n - j0 : kt);
    __syncthreads();
    load_key_tile(kv, keys, f, j0, nj, D, ks);
    __syncthreads();
    if (warp < HG && lane < nj) {
      // a = q . k over all channels, b = dout . v over the first dv: one chain of FMAs each, in
      // channel order (b's zero pads add nothing).
      const A* kr = ks + lane * kstride;
      A a[HPW] = {}, b[HPW] = {};
      constexpr int V = vec_of<A>();
      for (int c = 0; c < dvP; c += V) {
        const Pack<A, V> k = *reinterpret_cast<const Pack<A, V>*>(kr + c);
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
          const int h = warp + kWarps * i;
          const Pack<A, V> qv = *reinterpret_cast<const Pack<A, V>*>(qs + h * DP + c);
          const Pack<A, V> dv_ = *reinterpret_cast<const Pack<A, V>*>(dos + h * dvP + c);
#pragma unroll
          for (int u = 0; u < V; ++u) {
            a[i] = dfma(qv.v[u], k.v[u], a[i]);
            b[i] = dfma(dv_.v[u], k.v[u], b[i]);
          }
        }
      }
      key_dots<HPW>(qs, DP, kr, dvP, DP, warp, a);
#pragma unroll
      for (int i = 0; i < HPW; ++i) {
        const A p = dexp(scale * a[i] - L[i]);
        ps[(warp + kWarps * i) * kTile + lane] = p * (b[i] - Dl[i]);
      }
    }
    __syncthreads();
    tile_accumulate<HG, CPT>(acc, ps, ks, kstride, nj, c0 + tid, D);
  }
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    if (h >= hv) break;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int c = c0 + tid + kThreads * k;
      if (c < D) st(dq, (t * H + h0 + h) * D + c, scale * acc[h][k]);
    }
  }
}

// Shared memory: pair rows [32] (i64), p [32], ds [32], the key row [D].
template <class A>
size_t dkv_smem(int D) {
  return sizeof(int64_t) * kPairs + sizeof(A) * size_t(2 * kPairs + D);
}

template <class T, int CPT, class Keys>
__global__ void __launch_bounds__(kThreads)
    attn_dkv_kernel(const T* __restrict__ q, const T* __restrict__ kv, const T* __restrict__ dout,
                    const acc_t<T>* __restrict__ lse, const acc_t<T>* __restrict__ delta, Keys keys,
                    T* __restrict__ dkv, int H, int D, int dv, acc_t<T> scale) {
  using A = acc_t<T>;
  extern __shared__ float4 smem4[];
  int64_t* prow = reinterpret_cast<int64_t*>(smem4);
  A* pp = reinterpret_cast<A*>(prow + kPairs);
  A* pd = pp + kPairs;
  A* kr = pd + kPairs;
  const int64_t s = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = int(blockIdx.y) * kThreads * CPT;
  const int64_t r0 = keys.readers_first(s), npairs = keys.readers_count(s) * H;
  for (int c = tid; c < D; c += kThreads) kr[c] = ld<A>(kv, s * D + c);
  A acck[CPT], accv[CPT];
#pragma unroll
  for (int k = 0; k < CPT; ++k) acck[k] = A(0), accv[k] = A(0);
  for (int64_t g0 = 0; g0 < npairs; g0 += kPairs) {
    __syncthreads();  // the previous step's pairs are no longer read (and the key row is in place)
#pragma unroll
    for (int i = 0; i < kPairs / kWarps; ++i) {
      const int slot = warp + kWarps * i;
      const int64_t g = g0 + slot;
      if (g >= npairs) break;  // warp-uniform
      const int64_t row = keys.reader_at(r0, g / H) * H + g % H;
      A a = 0, b = 0;
      for (int c = lane; c < D; c += 32) a = dfma(ld<A>(q, row * D + c), kr[c], a);
      for (int c = lane; c < dv; c += 32) b = dfma(ld<A>(dout, row * dv + c), kr[c], b);
      a = warp_sum(a);
      b = warp_sum(b);
      if (lane == 0) {
        const A p = dexp(scale * a - lse[row]);
        prow[slot] = row;
        pp[slot] = p;
        pd[slot] = p * (b - delta[row]);
      }
    }
    __syncthreads();
    const int np = int(npairs - g0 < kPairs ? npairs - g0 : kPairs);
    for (int i = 0; i < np; ++i) {
      const int64_t row = prow[i];
      const A p = pp[i], d = pd[i];
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int c = c0 + tid + kThreads * k;
        if (c < D) acck[k] = dfma(d, ld<A>(q, row * D + c), acck[k]);
        if (c < dv) accv[k] = dfma(p, ld<A>(dout, row * dv + c), accv[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const int c = c0 + tid + kThreads * k;
    if (c < D) st(dkv, s * D + c, (c < dv ? accv[k] : A(0)) + scale * acck[k]);
  }
}

// ---- attention target ---------------------------------------------------------------------------

// Shared memory: q [HG, padded D], key tile [kt, stride], e [HG, 32], warp sums [8].
template <class A>
size_t target_smem(int hg, int kt, int D, int) {
  return sizeof(A) * size_t(hg * padded<A>(D) + kt * key_stride<A>(D) + hg * kTile + kWarps);
}

template <class T, int HG, class Keys>
__global__ void __launch_bounds__(kThreads)
    target_kernel(const T* __restrict__ q, const T* __restrict__ kv, Keys keys,
                  const acc_t<T>* __restrict__ lse, acc_t<T>* __restrict__ out, int H, int D,
                  int64_t W, int kt, acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int HPW = heads_per_warp<HG>();
  extern __shared__ float4 smem4[];
  const int DP = padded<A>(D), kstride = key_stride<A>(D);
  A* qs = reinterpret_cast<A*>(smem4);
  A* ks = qs + HG * DP;
  A* es = ks + kt * kstride;
  A* red = es + HG * kTile;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t f = keys.first(t), n = keys.count(t);
  A* orow = out + t * W;
  for (int64_t j = tid; j < W; j += kThreads) orow[j] = A(0);
  for (int h0 = 0; h0 < H; h0 += HG) {
    const int hv = H - h0 < HG ? H - h0 : HG;
    __syncthreads();  // the previous group's q rows are no longer read
    load_rows(q, (t * H + h0) * D, hv, HG, D, DP, qs);
    A L[HPW];
#pragma unroll
    for (int i = 0; i < HPW; ++i) {
      const int h = warp + kWarps * i;
      L[i] = h < hv ? lse[t * H + h0 + h] : A(0);
    }
    for (int64_t j0 = 0; j0 < n; j0 += kt) {
      const int nj = int(n - j0 < kt ? n - j0 : kt);
      __syncthreads();
      load_key_tile(kv, keys, f, j0, nj, D, ks);
      __syncthreads();
      if (warp < HG) {
        A dot[HPW] = {};
        key_dots<HPW>(qs, DP, ks + (lane < nj ? lane : 0) * kstride, 0, DP, warp, dot);
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
          const int h = warp + kWarps * i;
          es[h * kTile + lane] = lane < nj && h < hv ? dexp(scale * dot[i] - L[i]) : A(0);
        }
      }
      __syncthreads();
      if (tid < nj) {
        const int64_t sl = keys.slot_at(f, j0 + tid);
        A a = h0 == 0 ? A(0) : orow[sl];
        for (int h = 0; h < hv; ++h) a += es[h * kTile + tid];
        orow[sl] = a;
      }
    }
  }
  __syncthreads();
  A part = 0;
  for (int64_t j = tid; j < n; j += kThreads) part += orow[keys.slot_at(f, j)];
  part = warp_sum(part);
  if (lane == 0) red[warp] = part;
  __syncthreads();
  A tot = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tot += red[w];
  for (int64_t j = tid; j < n; j += kThreads) {
    const int64_t sl = keys.slot_at(f, j);
    orow[sl] = orow[sl] / tot;
  }
}

// ---- host side ----------------------------------------------------------------------------------

struct Geom {
  int hg = 16, kt = kTile;
  size_t smem = 0;
};

// The head group (4 for H <= 4, else 16, then 4) and the largest key tile (32, 16, ..., 1) whose
// shared memory bytes(hg, kt, D, dv) fits the device.
template <class F>
Geom pick_geom(int H, int D, int dv, F&& bytes, const char* what) {
  const size_t optin = size_t(smem_optin());
  for (int hg : {H <= 4 ? 4 : 16, 4})
    for (int kt = kTile; kt >= 1; kt /= 2)
      if (bytes(hg, kt, D, dv) <= optin) return {hg, kt, bytes(hg, kt, D, dv)};
  HLM_FAIL("{}: D_qk = {} (d_v = {}) needs more shared memory than the device's {} bytes", what, D,
           dv, optin);
}

// Channels per thread (1, 2 or 4) for n channels; n > 1024 is split into blocks of 1024.
int cpt_for(int n) {
  return n <= kThreads ? 1 : n <= 2 * kThreads ? 2 : 4;
}
unsigned chunks_for(int n, int cpt) {
  return n <= 0 ? 1u : unsigned((n + kThreads * cpt - 1) / (kThreads * cpt));
}

template <class F>
void with_hg(int hg, F&& f) {
  if (hg == 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 16>{});
  }
}
template <class F>
void with_cpt(int cpt, F&& f) {
  if (cpt == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (cpt == 2) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

unsigned query_blocks(int64_t T, int H, int hg, const char* what) {
  const int64_t b = T * ((H + hg - 1) / hg);
  HLM_CHECK(b < (int64_t(1) << 31), "{}: {} blocks exceed the grid limit", what, b);
  return unsigned(b);
}

int as_int(int64_t v, const char* what, const char* name) {
  HLM_CHECK(v >= 0 && v < (int64_t(1) << 31), "{}: {} = {} does not fit the CUDA kernels", what,
            name, v);
  return int(v);
}

PatternKeys pattern_keys(const DsaPatternDev& d) {
  return {cptr<int64_t>(d.row_ptr),
          cptr<int64_t>(d.key),
          cptr<int32_t>(d.slot),
          cptr<int64_t>(d.key_ptr),
          cptr<int64_t>(d.key_entry),
          cptr<int64_t>(d.query),
          d.W,
          d.q0};
}
DenseKeys dense_keys(const DsaLayoutDev& d) {
  DenseKeys k{cptr<int64_t>(d.doc_start), cptr<int64_t>(d.key_start), cptr<int64_t>(d.key_end)};
  k.q0 = d.q0;
  k.nq = d.T;
  return k;
}

// Forward (out != nullptr) or lse only (out == nullptr, dv = 0) over the keys `keys`.
template <class T, class Keys>
void launch_fwd(const T* q, const T* kv, Keys keys, T* out, acc_t<T>* lse, int64_t T_, int H, int D,
                int dv, double scale, const char* what) {
  using A = acc_t<T>;
  if (T_ == 0 || H == 0) return;
  if constexpr (std::is_same_v<T, nv_bf16>) {
    // BF16 on tensor cores (dsa_attention_mma.cu) where the shapes fit.
    if (attention_fwd_mma(q, kv, keys, out, lse, T_, H, D, dv, scale, what)) return;
  }
  const Geom g = pick_geom(H, D, dv, fwd_smem<A>, what);
  const int cpt = cpt_for(dv);
  const dim3 grid(query_blocks(T_, H, g.hg, what), chunks_for(dv, cpt));
  with_hg(g.hg, [&](auto hgc) {
    constexpr int HG = decltype(hgc)::value;
    auto go = [&](auto cc) {
      constexpr int CPT = decltype(cc)::value;
      set_smem(reinterpret_cast<const void*>(&attn_fwd_kernel<T, HG, CPT, Keys>), g.smem, what);
      attn_fwd_kernel<T, HG, CPT, Keys>
          <<<grid, kThreads, g.smem>>>(q, kv, keys, out, lse, H, D, dv, g.kt, A(scale));
      check_launch(what);
    };
    with_cpt(cpt, go);
  });
}

// out [T, W] must be zeroed by the caller when H == 0.
template <class T, class Keys>
void launch_target(const T* q, const T* kv, Keys keys, acc_t<T>* out, int64_t T_, int H, int D,
                   int64_t W, double scale, const acc_t<T>* known_lse = nullptr) {
  using A = acc_t<T>;
  const char* what = "attention_target";
  if (T_ == 0 || W == 0 || H == 0) return;
  Tensor lse_t;
  const A* lse = known_lse;
  if (lse == nullptr) {
    lse_t = alloc({T_, H}, std::is_same_v<A, double> ? DType::f64 : DType::f32);
    launch_fwd<T, Keys>(q, kv, keys, nullptr, mptr<A>(lse_t), T_, H, D, 0, scale, what);
    lse = cptr<A>(lse_t);
  }
  if constexpr (std::is_same_v<T, nv_bf16>) {
    // BF16 on tensor cores (dsa_attention_mma.cu) where the shapes fit.
    if (attention_target_mma(q, kv, keys, lse, out, T_, H, D, W, scale, what)) return;
  }
  const Geom g = pick_geom(H, D, 0, target_smem<A>, what);
  HLM_CHECK(T_ < (int64_t(1) << 31), "{}: T = {} exceeds the grid limit", what, T_);
  with_hg(g.hg, [&](auto hgc) {
    constexpr int HG = decltype(hgc)::value;
    set_smem(reinterpret_cast<const void*>(&target_kernel<T, HG, Keys>), g.smem, what);
    target_kernel<T, HG, Keys>
        <<<unsigned(T_), kThreads, g.smem>>>(q, kv, keys, lse, out, H, D, W, g.kt, A(scale));
    check_launch(what);
  });
}

// The backward over the keys `keys` (nkeys key rows for dkv): Delta, then dq per query, then dkv
// per key over its readers. T, D > 0 and H > 0 here.
template <class Keys>
void launch_bwd(const Tensor& q, const Tensor& kv, Keys keys, int64_t nkeys, int64_t d_v,
                double scale, const Tensor& out, const Tensor& lse, const Tensor& d_out, Tensor& dq,
                Tensor& dkv, const char* what) {
  const int64_t T = q.size(0);
  const int H = as_int(q.size(1), what, "H"), D = as_int(q.size(2), what, "D_qk");
  const int dv = as_int(d_v, what, "d_v");
  dispatch_storage(q.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    const Tensor delta = alloc({T, H}, std::is_same_v<A, double> ? DType::f64 : DType::f32);
    attn_delta_kernel<T_><<<blocks_for(T * H, kWarps), kThreads>>>(cptr<T_>(d_out), cptr<T_>(out),
                                                                   mptr<A>(delta), T * H, dv);
    check_launch((std::string(what) + " (Delta)").c_str());
    if constexpr (std::is_same_v<T_, nv_bf16>) {
      // BF16 on tensor cores (dsa_attention_mma.cu) where the shapes fit.
      if (attention_bwd_mma(cptr<T_>(q), cptr<T_>(kv), cptr<T_>(d_out), cptr<float>(lse),
                            cptr<float>(delta), keys, nkeys, keys.width, mptr<T_>(dq),
                            mptr<T_>(dkv), T, H, D, dv, scale, what))
        return;
    }
    // dq: per query, as the forward.
    const Geom g = pick_geom(H, D, dv, dq_smem<A>, what);
    const int cpt = cpt_for(D);
    const dim3 grid(query_blocks(T, H, g.hg, what), chunks_for(D, cpt));
    with_hg(g.hg, [&](auto hgc) {
      constexpr int HG = decltype(hgc)::value;
      with_cpt(cpt, [&](auto cc) {
        constexpr int CPT = decltype(cc)::value;
        set_smem(reinterpret_cast<const void*>(&attn_dq_kernel<T_, HG, CPT, Keys>), g.smem, what);
        attn_dq_kernel<T_, HG, CPT, Keys><<<grid, kThreads, g.smem>>>(
            cptr<T_>(q), cptr<T_>(kv), cptr<T_>(d_out), cptr<A>(lse), cptr<A>(delta), keys,
            mptr<T_>(dq), H, D, dv, g.kt, A(scale));
        check_launch((std::string(what) + " (dq)").c_str());
      });
    });
    // dkv: per key over its readers.
    const size_t smem = dkv_smem<A>(D);
    HLM_CHECK(smem <= size_t(smem_optin()), "{}: D_qk = {} needs too much shared memory", what, D);
    HLM_CHECK(nkeys < (int64_t(1) << 31), "{}: {} keys exceed the grid limit", what, nkeys);
    if (nkeys == 0) return;
    const dim3 kgrid(unsigned(nkeys), chunks_for(D, cpt));
    with_cpt(cpt, [&](auto cc) {
      constexpr int CPT = decltype(cc)::value;
      set_smem(reinterpret_cast<const void*>(&attn_dkv_kernel<T_, CPT, Keys>), smem, what);
      attn_dkv_kernel<T_, CPT, Keys>
          <<<kgrid, kThreads, smem>>>(cptr<T_>(q), cptr<T_>(kv), cptr<T_>(d_out), cptr<A>(lse),
                                      cptr<A>(delta), keys, mptr<T_>(dkv), H, D, dv, A(scale));
      check_launch((std::string(what) + " (dkv)").c_str());
    });
  });
}

}  // namespace

void sparse_attention(const Tensor& q, const Tensor& kv, const DsaPatternDev& pd, int64_t d_v,
                      double scale, Tensor& out, Tensor& lse) {
  const char* what = "sparse_attention";
  const int64_t T = q.size(0);
  const int H = as_int(q.size(1), what, "H"), D = as_int(q.size(2), what, "D_qk");
  const int dv = as_int(d_v, what, "d_v");
  if (T == 0 || H == 0) return;
  dispatch_storage(q.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    launch_fwd<T_, PatternKeys>(cptr<T_>(q), cptr<T_>(kv), pattern_keys(pd), mptr<T_>(out),
                                mptr<A>(lse), T, H, D, dv, scale, what);
  });
}

void sparse_attention_backward(const Tensor& q, const Tensor& kv, const DsaPatternDev& pd,
                               int64_t d_v, double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv) {
  const char* what = "sparse_attention_backward";
  if (q.size(0) == 0 || q.size(2) == 0) return;
  if (q.size(1) == 0) return dkv.zero_();
  launch_bwd(q, kv, pattern_keys(pd), pd.nkeys, d_v, scale, out, lse, d_out, dq, dkv, what);
}

void causal_attention(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                      int64_t d_v, double scale, Tensor& out, Tensor& lse) {
  const char* what = "causal_attention";
  const int64_t T = q.size(0);
  const int H = as_int(q.size(1), what, "H"), D = as_int(q.size(2), what, "D_qk");
  const int dv = as_int(d_v, what, "d_v");
  if (T == 0 || H == 0) return;
  const DsaLayoutDev lay = upload_layout(w, 1);
  dispatch_storage(q.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    launch_fwd<T_, DenseKeys>(cptr<T_>(q), cptr<T_>(kv), dense_keys(lay), mptr<T_>(out),
                              mptr<A>(lse), T, H, D, dv, scale, what);
  });
}

void causal_attention_backward(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                               int64_t d_v, double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv) {
  const char* what = "causal_attention_backward";
  if (q.size(0) == 0 || q.size(2) == 0) return dkv.zero_();
  if (q.size(1) == 0) return dkv.zero_();
  const DsaLayoutDev lay = upload_layout(w, 1);
  // Entries numbered query by query (the tensor-core backward's workspace rows): each query's
  // keys follow the window's earlier queries' (r + 1 keys at document position r).
  std::vector<int64_t> base(size_t(lay.T));
  int64_t e = 0, longest = 0;
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t) {
      base[size_t(t)] = e;
      e += w.pos(m, t) + 1;
      longest = std::max(longest, w.pos(m, t) + 1);
    }
  const Tensor entry_base = to_device(base);
  DenseKeys keys = dense_keys(lay);
  keys.entry_base = cptr<int64_t>(entry_base);
  keys.width = longest;
  launch_bwd(q, kv, keys, kv.size(0), d_v, scale, out, lse, d_out, dq, dkv, what);
}

void attention_target(const Tensor& q, const Tensor& kv, const DsaPatternDev& pd, double scale,
                      Tensor& out, const Tensor& lse) {
  const char* what = "attention_target_at";
  const int H = as_int(q.size(1), what, "H"), D = as_int(q.size(2), what, "D_qk");
  if (pd.T == 0) return;
  if (H == 0) return out.zero_();
  dispatch_storage(q.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    launch_target<T_, PatternKeys>(cptr<T_>(q), cptr<T_>(kv), pattern_keys(pd), mptr<A>(out), pd.T,
                                   H, D, pd.W, scale, lse.defined() ? cptr<A>(lse) : nullptr);
  });
}

void attention_target_dense(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                            double scale, Tensor& out) {
  const char* what = "attention_target";
  const int64_t T = q.size(0);
  const int H = as_int(q.size(1), what, "H"), D = as_int(q.size(2), what, "D_qk");
  if (T == 0) return;
  if (H == 0) return out.zero_();
  const DsaLayoutDev lay = upload_layout(w, 1);
  dispatch_storage(q.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    launch_target<T_, DenseKeys>(cptr<T_>(q), cptr<T_>(kv), dense_keys(lay), mptr<A>(out), T, H, D,
                                 out.size(1), scale);
  });
}

}  // namespace hlm::ops::cuda
