// The KPool ops on the CPU (ops/dsa_kpool.h, the reference; entry points in
// ops/cpu/dsa_kpool.h).
#include "ops/cpu/dsa_kpool.h"

#include <algorithm>
#include <cmath>

#include "ops/dsa_common.h"

namespace hlm::ops::cpu {
namespace {

struct CompressArgs {
  Tensor k, gate, ape;
  std::vector<int64_t> cu, cp;
  int64_t T = 0, D = 0, P = 0, NP = 0;
};

CompressArgs args_of(const Tensor& k, const Tensor& gate, const Tensor& ape,
                     const std::vector<int64_t>& cu) {
  CompressArgs a;
  a.T = k.size(0), a.D = k.size(1), a.P = ape.size(0);
  a.cu = cu;
  a.cp = dsa_detail::pool_offsets(a.cu, a.P);
  a.NP = a.cp.back();
  a.k = k, a.gate = gate, a.ape = ape;
  return a;
}

// First token of each global pool.
std::vector<int64_t> pool_starts(const CompressArgs& a) {
  std::vector<int64_t> st(static_cast<size_t>(a.NP));
  for (size_t d = 0; d + 1 < a.cu.size(); ++d)
    for (int64_t p = a.cp[d]; p < a.cp[d + 1]; ++p) st[size_t(p)] = a.cu[d] + (p - a.cp[d]) * a.P;
  return st;
}

// Softmax weights a[j] over the pool's P slots for channel c (max-subtracted, in F).
template <class F>
void pool_alpha(const F* g, const F* ape, int64_t s, int64_t c, int64_t P, int64_t D, F* alpha) {
  F m = -INFINITY;
  for (int64_t j = 0; j < P; ++j) {
    alpha[j] = g[(s + j) * D + c] + ape[j * D + c];
    m = std::max(m, alpha[j]);
  }
  F sum = 0;
  for (int64_t j = 0; j < P; ++j) {
    alpha[j] = std::exp(alpha[j] - m);
    sum += alpha[j];
  }
  for (int64_t j = 0; j < P; ++j) alpha[j] /= sum;
}

// For every pool p (first token s) and channel c, pools in parallel: the softmax weights alpha
// [P] and the pooled key K = sum_j alpha[j] k[s + j, c] (j ascending), handed to
// fn(p, s, c, alpha, K).
template <class F, class Fn>
void for_each_pooled(const CompressArgs& a, const std::vector<int64_t>& st, Fn&& fn) {
  const F* k = a.k.data<F>();
  const F* g = a.gate.data<F>();
  const F* ape = a.ape.data<F>();
  const int64_t P = a.P, D = a.D;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < a.NP; ++p) {
    std::vector<F> alpha(static_cast<size_t>(P));
    const int64_t s = st[size_t(p)];
    for (int64_t c = 0; c < D; ++c) {
      pool_alpha(g, ape, s, c, P, D, alpha.data());
      F K = 0;
      for (int64_t j = 0; j < P; ++j) K += alpha[size_t(j)] * k[(s + j) * D + c];
      fn(p, s, c, alpha.data(), K);
    }
  }
}

template <class F>
void compress_fwd(const CompressArgs& a, Tensor& out) {
  F* o = out.data<F>();
  const int64_t D = a.D;
  for_each_pooled<F>(a, pool_starts(a),
                     [&](int64_t p, int64_t, int64_t c, const F*, F K) { o[p * D + c] = K; });
}

template <class F>
void compress_bwd(const CompressArgs& a, const Tensor& dpool, KPoolCompressGrads& r) {
  const F* k = a.k.data<F>();
  const F* dK = dpool.data<F>();
  r.dk.zero_();
  r.dgate.zero_();
  r.dape.zero_();
  F* dk = r.dk.data<F>();
  F* dg = r.dgate.data<F>();
  F* dA = r.dape.data<F>();
  const std::vector<int64_t> st = pool_starts(a);
  const int64_t P = a.P, D = a.D;
  for_each_pooled<F>(a, st, [&](int64_t p, int64_t s, int64_t c, const F* alpha, F K) {
    const F d = dK[p * D + c];
    for (int64_t j = 0; j < P; ++j) {
      dk[(s + j) * D + c] = alpha[j] * d;
      dg[(s + j) * D + c] = alpha[j] * (k[(s + j) * D + c] - K) * d;
    }
  });
  // dape: per (slot, channel), the pools in id order.
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < D; ++c)
    for (int64_t p = 0; p < a.NP; ++p)
      for (int64_t j = 0; j < P; ++j) dA[j * D + c] += dg[(st[size_t(p)] + j) * D + c];
}

template <class F>
void pool_target_dense(const Tensor& tt, const dsa_detail::QueryWindow& w, int64_t P, Tensor& out) {
  const F* x = tt.data<F>();
  F* o = out.data<F>();
  const int64_t Wt = tt.size(1), Wp = out.size(1);
  std::fill(o, o + out.numel(), F(0));
  for (size_t d = 0; d < w.docs(); ++d) {
#pragma omp parallel for schedule(static)
    for (int64_t t = w.qcu[d]; t < w.qcu[d + 1]; ++t) {
      const int64_t n = (w.pos(d, t) + 1) / P;
      F tot = 0;
      for (int64_t p = 0; p < n; ++p) {
        F s = 0;
        for (int64_t j = 0; j < P; ++j) s += x[t * Wt + p * P + j];
        o[t * Wp + p] = s;
        tot += s;
      }
      if (tot > F(0))
        for (int64_t p = 0; p < n; ++p) o[t * Wp + p] /= tot;
    }
  }
}

template <class F>
void pool_target_sparse(const Tensor& tt, const std::vector<int64_t>& pools, int64_t P,
                        Tensor& out) {
  const F* x = tt.data<F>();
  F* o = out.data<F>();
  const int64_t T = out.size(0), G = out.size(1), Wt = tt.size(1);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    F tot = 0;
    for (int64_t g = 0; g < G; ++g) {
      F s = 0;
      if (pools[size_t(t * G + g)] >= 0)
        for (int64_t j = 0; j < P; ++j) s += x[t * Wt + g * P + j];
      o[t * G + g] = s;
      tot += s;
    }
    if (tot > F(0))
      for (int64_t g = 0; g < G; ++g) o[t * G + g] /= tot;
  }
}

}  // namespace

void kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                    const std::vector<int64_t>& cu, Tensor& pooled) {
  const CompressArgs a = args_of(k, gate, ape, cu);
  if (k.dtype() == DType::f64)
    compress_fwd<double>(a, pooled);
  else
    compress_fwd<float>(a, pooled);
}

void kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                             const std::vector<int64_t>& cu, const Tensor& d_pooled,
                             KPoolCompressGrads& g) {
  const CompressArgs a = args_of(k, gate, ape, cu);
  if (k.dtype() == DType::f64)
    compress_bwd<double>(a, d_pooled, g);
  else
    compress_bwd<float>(a, d_pooled, g);
}

void kpool_select_indices(const Tensor& pools, const dsa_detail::QueryWindow& w, int64_t K,
                          int64_t P, bool always_select_tail, Tensor& indices) {
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(w.cu, P);
  const int64_t G = K / P, W = indices.size(1);
  const int32_t* pl = pools.data<int32_t>();
  int32_t* o = indices.data<int32_t>();
  for (size_t d = 0; d < w.docs(); ++d) {
    const int64_t first_tok = w.first(d), first_pool = cp[size_t(w.doc[d])];
#pragma omp parallel for schedule(static)
    for (int64_t t = w.qcu[d]; t < w.qcu[d + 1]; ++t) {
      int32_t* row = o + t * W;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t p = pl[t * G + g];
        for (int64_t j = 0; j < P; ++j)
          row[g * P + j] = p < 0 ? -1 : int32_t(first_tok + (p - first_pool) * P + j);
      }
      if (always_select_tail) {
        const int64_t r = w.pos(d, t);
        const int64_t first = (r + 1) / P * P;  // relative start of the incomplete pool
        for (int64_t j = 0; j < P - 1; ++j)
          row[K + j] = first + j <= r ? int32_t(first_tok + first + j) : -1;
      }
    }
  }
}

void kpool_pool_target_dense(const Tensor& token_target, const dsa_detail::QueryWindow& w,
                             int64_t P, Tensor& out) {
  if (token_target.dtype() == DType::f64)
    pool_target_dense<double>(token_target, w, P, out);
  else
    pool_target_dense<float>(token_target, w, P, out);
}

void kpool_pool_target_sparse(const Tensor& token_target, const std::vector<int64_t>& pools,
                              int64_t P, Tensor& out) {
  if (token_target.dtype() == DType::f64)
    pool_target_sparse<double>(token_target, pools, P, out);
  else
    pool_target_sparse<float>(token_target, pools, P, out);
}

}  // namespace hlm::ops::cpu
