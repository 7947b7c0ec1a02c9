// DSA selection and the indexer loss on CUDA (ops/cuda/dsa_select.cuh): the math of
// ops/cpu/dsa_indexer.cpp (topk_rows), ops/cpu/dsa_kpool.cpp (selection expansion, pool targets)
// and ops/cpu/dsa_indexer_loss.cpp (kl_rows). No atomics anywhere: every count and sum has a fixed
// order, so each result repeats bit for bit, and the selections equal the CPU's exactly.
//
// topk_select: one 256-thread block per query row. A score maps to an unsigned key whose order is
//   the selection order (NaN lowest, -0 as +0, then the IEEE order), so "the m best" is "the m
//   largest keys, lower index first among equal keys". A radix select finds the m-th largest key
//   4 bits at a time (8 passes for f32 keys, 16 for f64): each thread counts the digits of its
//   candidates that match the prefix found so far into its own 16 counters (a column of shared
//   memory), the 16 bin totals are summed over the threads in a fixed order, and every thread
//   walks the bins from the top to the digit where the remaining count falls. Then one pass in
//   index order takes every key above the threshold and the first `need` keys equal to it (ranks
//   from a block-wide prefix count), and writes them compacted in increasing index order (a second
//   prefix count). Rows with at most k candidates take them all without looking at the scores.
//   Cost: (passes + 1) reads of the row; at 2^20 candidates a row stays in L2.
// kpool_select_indices: one thread per output column.
// pool targets and the KL loss: one 256-thread block per row. Row sums run per thread in column
//   order, then over the warp by an xor butterfly, then over the 8 warps in warp order. The KL
//   loss writes each row's loss (f64), whether the row had an entry, and whether its target held
//   mass outside the set; the host checks, sums the rows in row order in f64 (as the CPU does)
//   and scales d_scores by the reduction's factor.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_select.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 4;
constexpr int kBins = 1 << kDigitBits;

__device__ __forceinline__ float dlog(float x) {
  return logf(x);
}
__device__ __forceinline__ double dlog(double x) {
  return log(x);
}

// ---- block-wide reductions and scans (kThreads threads, fixed order) ----

// Sum over the block; every thread gets the result. sh: kWarps slots.
template <class A>
__device__ __forceinline__ A block_sum(A v, A* sh) {
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  A s = sh[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) s += sh[w];
  return s;
}

template <class A>
__device__ __forceinline__ A block_max(A v, A* sh) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  A s = sh[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) s = sh[w] > s ? sh[w] : s;
  return s;
}

// Exclusive prefix count of v (0 / 1) over the block in thread order; total: the block's count.
__device__ __forceinline__ int block_excl_scan(int v, int* sh, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  __syncthreads();  // sh may still be read by a previous scan
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? sh[w] : 0;
    all += sh[w];
  }
  total = all;
  return before + x - v;
}

// ---- order keys ----

template <class F>
struct OrderKey;
template <>
struct OrderKey<float> {
  using U = uint32_t;
  static constexpr int kBits = 32;
  __device__ static U of(float f) {
    if (f != f) return 0;   // NaN ranks below every number
    if (f == 0.f) f = 0.f;  // -0 ties with +0, as in the CPU's comparison
    const U u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
};
template <>
struct OrderKey<double> {
  using U = unsigned long long;
  static constexpr int kBits = 64;
  __device__ static U of(double f) {
    if (f != f) return 0;
    if (f == 0.0) f = 0.0;
    const U u = U(__double_as_longlong(f));
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  }
};

template <class F>
__global__ void __launch_bounds__(kThreads)
    topk_kernel(const F* __restrict__ scores, int64_t W, const int64_t* __restrict__ doc_start,
                const int64_t* __restrict__ key_base, int64_t pool, int64_t k,
                int32_t* __restrict__ out, const int64_t* __restrict__ ncand = nullptr) {
  using K = OrderKey<F>;
  using U = typename K::U;
  __shared__ int cnt[kBins][kThreads];
  __shared__ int bins[kBins];
  __shared__ int scan_sh[kWarps];
  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x;
  // Candidates: the query's visible keys of its document, or (ncand) the first ncand[t] columns.
  const int64_t n = ncand ? ncand[t] : (t - doc_start[t] + 1) / pool,
                base = ncand ? 0 : key_base[t];
  const int64_t m = n < k ? n : k;
  const F* row = scores + t * W;
  int32_t* orow = out + t * k;
  for (int64_t j = m + tid; j < k; j += kThreads) orow[j] = -1;
  if (m == n) {  // every candidate is selected
    for (int64_t j = tid; j < n; j += kThreads) orow[j] = int32_t(base + j);
    return;
  }
  // Radix select of the m-th largest key: prefix / mask hold the digits found so far, need the
  // number of keys still to take among those that match them.
  U prefix = 0, mask = 0;
  int64_t need = m;
  for (int shift = K::kBits - kDigitBits; shift >= 0; shift -= kDigitBits) {
#pragma unroll
    for (int b = 0; b < kBins; ++b) cnt[b][tid] = 0;
    for (int64_t j = tid; j < n; j += kThreads) {
      const U key = K::of(row[j]);
      if ((key & mask) == prefix) ++cnt[int((key >> shift) & U(kBins - 1))][tid];
    }
    __syncthreads();
    for (int b = threadIdx.x >> 5; b < kBins; b += kWarps) {
      int s = 0;
      for (int i = threadIdx.x & 31; i < kThreads; i += 32) s += cnt[b][i];
      s = warp_sum(s);
      if ((threadIdx.x & 31) == 0) bins[b] = s;
    }
    __syncthreads();
    int digit = kBins - 1;
    for (; digit > 0; --digit) {
      if (need <= bins[digit]) break;
      need -= bins[digit];
    }
    prefix |= U(digit) << shift;
    mask |= U(kBins - 1) << shift;
    __syncthreads();  // cnt and bins are rewritten by the next pass
  }
  // prefix is now the m-th largest key; take the keys above it and the first `need` equal to it.
  int64_t eq_before = 0, written = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kThreads) {
    const int64_t j = c0 + tid;
    const U key = j < n ? K::of(row[j]) : U(0);
    const bool gt = j < n && key > prefix, eq = j < n && key == prefix;
    int eq_total = 0, sel_total = 0;
    const int eq_rank = block_excl_scan(eq ? 1 : 0, scan_sh, eq_total);
    const bool sel = gt || (eq && eq_before + eq_rank < need);
    const int pos = block_excl_scan(sel ? 1 : 0, scan_sh, sel_total);
    if (sel) orow[written + pos] = int32_t(base + j);
    eq_before += eq_total;
    written += sel_total;
  }
}

// (Rows of a query window: doc_start is the document's first token minus q0, DsaLayoutDev.)
template <class I>
__global__ void expand_kernel(const I* __restrict__ pools, const int64_t* __restrict__ doc_start,
                              const int64_t* __restrict__ pool_base, int64_t q0, int64_t T,
                              int64_t K, int64_t P, int64_t Wout, int32_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * Wout) return;
  const int64_t t = i / Wout, col = i % Wout, s0 = doc_start[t] + q0;
  if (col < K) {
    const int64_t p = int64_t(pools[t * (K / P) + col / P]);
    out[i] = p < 0 ? -1 : int32_t(s0 + (p - pool_base[t]) * P + col % P);
  } else {
    const int64_t r = t - doc_start[t], first = (r + 1) / P * P, j = col - K;
    out[i] = first + j <= r ? int32_t(s0 + first + j) : -1;
  }
}

// Pool targets: row t's G output columns; column g (< n) is the sum of P token columns
// (dense: g * P + j; sparse: the group g, when pools[t, g] >= 0), then the row is L1-normalised.
template <class F, class I>
__global__ void __launch_bounds__(kThreads)
    pool_target_kernel(const F* __restrict__ x, int64_t Wt, const int64_t* __restrict__ doc_start,
                       const I* __restrict__ pools, int64_t P, int64_t G, F* __restrict__ out) {
  __shared__ F sh[kWarps];
  const int64_t t = blockIdx.x;
  const int64_t n = pools ? G : (t - doc_start[t] + 1) / P;
  const F* xr = x + t * Wt;
  F* orow = out + t * G;
  F tot = 0;
  for (int64_t g = threadIdx.x; g < G; g += kThreads) {
    F s = 0;
    if (g < n && (!pools || pools[t * G + g] >= 0))
      for (int64_t j = 0; j < P; ++j) s += xr[g * P + j];
    orow[g] = s;
    tot += s;
  }
  tot = block_sum(tot, sh);
  if (tot > F(0))
    for (int64_t g = threadIdx.x; g < n; g += kThreads) orow[g] /= tot;
}

struct KlRow {
  double* loss;  // [T]
  int* used;     // [T]
  int* bad;      // [T]
};

template <class F>
__global__ void __launch_bounds__(kThreads)
    kl_kernel(const F* __restrict__ s, const F* __restrict__ p, int64_t W, F eps, F* __restrict__ d,
              KlRow rows) {
  __shared__ F shf[kWarps];
  __shared__ int shi[kWarps];
  const F ninf = -std::numeric_limits<F>::infinity();
  const int64_t t = blockIdx.x;
  const F* sr = s + t * W;
  const F* pr = p + t * W;
  F* dr = d + t * W;
  F m = ninf;
  int n = 0, bad = 0;
  for (int64_t j = threadIdx.x; j < W; j += kThreads) {
    if (sr[j] == ninf) {
      bad |= pr[j] != F(0);
      continue;
    }
    ++n;
    m = sr[j] > m ? sr[j] : m;
  }
  n = block_sum(n, shi);
  bad = block_sum(bad, shi);
  m = block_max(m, shf);
  if (threadIdx.x == 0) {
    rows.used[t] = n > 0;
    rows.bad[t] = bad;
    rows.loss[t] = 0;
  }
  if (n == 0) {
    for (int64_t j = threadIdx.x; j < W; j += kThreads) dr[j] = F(0);
    return;
  }
  F sum = 0;
  for (int64_t j = threadIdx.x; j < W; j += kThreads)
    if (sr[j] != ninf) sum += dexp(sr[j] - m);
  sum = block_sum(sum, shf);
  F loss = 0, c = 0;
  for (int64_t j = threadIdx.x; j < W; j += kThreads) {
    if (sr[j] == ninf) {
      dr[j] = F(0);
      continue;
    }
    const F pi = dexp(sr[j] - m) / sum;
    loss += pr[j] * (dlog(pr[j] + eps) - dlog(pi + eps));
    c += pr[j] * pi / (pi + eps);
    dr[j] = pi;  // stash pi; this thread rewrites it below
  }
  loss = block_sum(loss, shf);
  c = block_sum(c, shf);
  if (threadIdx.x == 0) rows.loss[t] = double(loss);
  for (int64_t j = threadIdx.x; j < W; j += kThreads) {
    if (sr[j] == ninf) continue;
    const F pi = dr[j];
    dr[j] = pi * c - pr[j] * pi / (pi + eps);
  }
}

template <class F>
__global__ void scale_kernel(F* __restrict__ x, int64_t n, F g) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= g;
}

// f(F{}) for an f32 / f64 tensor (the front doors allow only these).
template <class Fn>
void dispatch_real(DType dt, Fn&& f) {
  if (dt == DType::f64)
    f(double{});
  else
    f(float{});
}
template <class Fn>
void dispatch_index(DType dt, Fn&& f) {
  if (dt == DType::i64)
    f(int64_t{});
  else
    f(int32_t{});
}

template <class T>
std::vector<T> to_host(const Tensor& t) {
  const Tensor c = t.to(Device::cpu);
  return std::vector<T>(c.data<T>(), c.data<T>() + c.numel());
}

// The forward over a cache: column j < K of query t holds position best[g] P + i (g = j / P,
// i = j % P) of its selected pools, the tail columns K + i the positions ncand P + i <= pos[t];
// each position's storage row (its sequence's page table) goes into the pattern entry at row_ptr[t]
// plus its rank among the row's filled columns (pools first, then the tail: slot order).
__global__ void cached_expand_kernel(
    const int32_t* __restrict__ best, const int64_t* __restrict__ ncand,
    const int64_t* __restrict__ pos, const int64_t* __restrict__ seq_of,
    const int64_t* __restrict__ pages, int64_t max_pages, int64_t page, int64_t T, int64_t W,
    int64_t K, int64_t P, const int64_t* __restrict__ row_ptr, int32_t* __restrict__ sel,
    int32_t* __restrict__ slot, int64_t* __restrict__ key, int64_t* __restrict__ query) {
  const int64_t G = K / P;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < T * W;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / W, j = idx - t * W, n = ncand[t], m = n < G ? n : G;
    int64_t p = -1, rank = 0;
    if (j < K) {
      const int64_t g = j / P;
      if (g < m) p = int64_t(best[t * G + g]) * P + j % P, rank = j;
    } else {
      const int64_t q = n * P + (j - K);
      if (q <= pos[t]) p = q, rank = m * P + (j - K);
    }
    sel[idx] = int32_t(p);
    if (p < 0) continue;
    const int64_t e = row_ptr[t] + rank;
    key[e] = pages[seq_of[t] * max_pages + p / page] * page + p % page;
    slot[e] = int32_t(j);
    query[e] = t;
  }
}

// One block per query: its candidates' entries.
__global__ void cached_candidates_kernel(const int64_t* __restrict__ ncand,
                                         const int64_t* __restrict__ seq_of,
                                         const int64_t* __restrict__ pages, int64_t max_pages,
                                         int64_t page, int64_t P,
                                         const int64_t* __restrict__ row_ptr,
                                         int32_t* __restrict__ slot, int64_t* __restrict__ key,
                                         int64_t* __restrict__ query) {
  const int64_t t = blockIdx.x, n = ncand[t], e0 = row_ptr[t];
  const int64_t* pg = pages + seq_of[t] * max_pages;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const int64_t p = j * P;  // the candidate's first token
    key[e0 + j] = (pg[p / page] * page + p % page) / P;
    slot[e0 + j] = int32_t(j);
    query[e0 + j] = t;
  }
}

}  // namespace

void cached_candidates(const Tensor& ncand, const Tensor& seq_of, const Tensor& pages, int64_t page,
                       int64_t P, const Tensor& row_ptr, Tensor& slot, Tensor& key, Tensor& query) {
  const int64_t T = ncand.numel();
  if (T == 0) return;
  cached_candidates_kernel<<<unsigned(T), kThreads>>>(
      cptr<int64_t>(ncand), cptr<int64_t>(seq_of), cptr<int64_t>(pages), pages.size(1), page, P,
      cptr<int64_t>(row_ptr), mptr<int32_t>(slot), mptr<int64_t>(key), mptr<int64_t>(query));
  check_launch("cached_candidates");
}

void cached_select(const Tensor& scores, const Tensor& ncand, const Tensor& pos,
                   const Tensor& seq_of, const Tensor& pages, int64_t page, int64_t K, int64_t P,
                   const Tensor& row_ptr, Tensor& sel, Tensor& slot, Tensor& key, Tensor& query) {
  const int64_t T = scores.size(0), W = sel.size(1), G = K / P;
  if (T == 0) return;
  Tensor best = alloc({T, G}, DType::i32);
  dispatch_real(scores.dtype(), [&](auto f) {
    using F = decltype(f);
    topk_kernel<F><<<unsigned(T), kThreads>>>(cptr<F>(scores), scores.size(1), nullptr, nullptr, 1,
                                              G, mptr<int32_t>(best), cptr<int64_t>(ncand));
  });
  check_launch("cached_select top-k");
  cached_expand_kernel<<<blocks_for(T * W, kThreads), kThreads>>>(
      cptr<int32_t>(best), cptr<int64_t>(ncand), cptr<int64_t>(pos), cptr<int64_t>(seq_of),
      cptr<int64_t>(pages), pages.size(1), page, T, W, K, P, cptr<int64_t>(row_ptr),
      mptr<int32_t>(sel), mptr<int32_t>(slot), mptr<int64_t>(key), mptr<int64_t>(query));
  check_launch("cached_select expand");
}

void topk_select(const Tensor& scores, const dsa_detail::QueryWindow& w, int64_t k, int64_t pool,
                 Tensor& out) {
  const int64_t T = scores.size(0);
  if (T == 0) return;
  const DsaLayoutDev lay = upload_layout(w, pool);
  dispatch_real(scores.dtype(), [&](auto f) {
    using F = decltype(f);
    topk_kernel<F>
        <<<unsigned(T), kThreads>>>(cptr<F>(scores), scores.size(1), cptr<int64_t>(lay.doc_start),
                                    cptr<int64_t>(lay.key_base), pool, k, mptr<int32_t>(out));
  });
  check_launch("topk_select");
}

void kpool_select_indices(const Tensor& pools, const dsa_detail::QueryWindow& w, int64_t K,
                          int64_t P, bool always_select_tail, Tensor& indices) {
  (void)always_select_tail;  // the width of `indices` says whether the tail columns are there
  const int64_t T = indices.size(0), Wout = indices.size(1);
  if (T == 0) return;
  const DsaLayoutDev lay = upload_layout(w, P);
  dispatch_index(pools.dtype(), [&](auto i) {
    using I = decltype(i);
    expand_kernel<I><<<blocks_for(T * Wout, kThreads), kThreads>>>(
        cptr<I>(pools), cptr<int64_t>(lay.doc_start), cptr<int64_t>(lay.key_base), w.q0, T, K, P,
        Wout, mptr<int32_t>(indices));
  });
  check_launch("kpool_select");
}

void kpool_pool_target_dense(const Tensor& token_target, const dsa_detail::QueryWindow& w,
                             int64_t P, Tensor& out) {
  const int64_t T = out.size(0);
  if (T == 0) return;
  const DsaLayoutDev lay = upload_layout(w, P);
  dispatch_real(token_target.dtype(), [&](auto f) {
    using F = decltype(f);
    pool_target_kernel<F, int32_t><<<unsigned(T), kThreads>>>(
        cptr<F>(token_target), token_target.size(1), cptr<int64_t>(lay.doc_start), nullptr, P,
        out.size(1), mptr<F>(out));
  });
  check_launch("kpool_pool_target_dense");
}

void kpool_pool_target_sparse(const Tensor& token_target, const Tensor& pools, int64_t P,
                              Tensor& out) {
  const int64_t T = out.size(0);
  if (T == 0) return;
  dispatch_real(token_target.dtype(), [&](auto f) {
    using F = decltype(f);
    dispatch_index(pools.dtype(), [&](auto i) {
      using I = decltype(i);
      pool_target_kernel<F, I>
          <<<unsigned(T), kThreads>>>(cptr<F>(token_target), token_target.size(1), nullptr,
                                      cptr<I>(pools), P, out.size(1), mptr<F>(out));
    });
  });
  check_launch("kpool_pool_target_sparse");
}

void indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff,
                     KlReduction reduction, IndexerKl& r) {
  const int64_t T = scores.size(0), W = scores.size(1);
  r.loss = 0;
  r.rows = 0;
  if (T == 0) return;
  Tensor loss = alloc({T}, DType::f64), used = alloc({T}, DType::i32), bad = alloc({T}, DType::i32);
  const KlRow rows{mptr<double>(loss), mptr<int>(used), mptr<int>(bad)};
  dispatch_real(scores.dtype(), [&](auto f) {
    using F = decltype(f);
    kl_kernel<F><<<unsigned(T), kThreads>>>(cptr<F>(scores), cptr<F>(target), W, F(kIndexerKlEps),
                                            mptr<F>(r.d_scores), rows);
  });
  check_launch("indexer_kl_loss");
  const std::vector<int32_t> u = to_host<int32_t>(used), b = to_host<int32_t>(bad);
  const std::vector<double> l = to_host<double>(loss);
  for (int64_t t = 0; t < T; ++t)
    HLM_CHECK(!b[size_t(t)],
              "indexer_kl_loss: target row {} has mass where the score is -inf (outside the "
              "row's set): scores and target must come from the same layout",
              t);
  double total = 0;
  for (int64_t t = 0; t < T; ++t) {
    total += l[size_t(t)];
    r.rows += u[size_t(t)];
  }
  const double g = reduction == KlReduction::sum ? coeff : (r.rows ? coeff / double(r.rows) : 0.0);
  r.loss = g * total;
  if (W == 0) return;
  dispatch_real(scores.dtype(), [&](auto f) {
    using F = decltype(f);
    scale_kernel<F><<<blocks_for(T * W, kThreads), kThreads>>>(mptr<F>(r.d_scores), T * W, F(g));
  });
  check_launch("indexer_kl_loss (scale)");
}

}  // namespace hlm::ops::cuda
