// CPU reference of the KPool ops (see ops/dsa_kpool.h).
#include <algorithm>
#include <cmath>

#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_kpool.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

struct CompressArgs {
  Tensor k, gate, ape;
  std::vector<int64_t> cu, cp;
  int64_t T = 0, D = 0, P = 0, NP = 0;
};

CompressArgs check_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                            const Tensor& cu_seqlens, const char* op) {
  detail::require_float(k, op, "k");
  detail::require_float(gate, op, "gate");
  detail::require_float(ape, op, "ape");
  detail::require_same_dtype(gate, k, op, "gate", "k");
  detail::require_same_dtype(ape, k, op, "ape", "k");
  HLM_CHECK(k.dim() == 2, "{}: k must be [T, d_I], got {}", op, k.describe());
  HLM_CHECK(ape.dim() == 2 && ape.size(0) >= 1 && ape.size(1) == k.size(1),
            "{}: ape must be [P, d_I] with P >= 1 and d_I = {}, got {}", op, k.size(1),
            ape.describe());
  CompressArgs a;
  a.T = k.size(0), a.D = k.size(1), a.P = ape.size(0);
  detail::require_shape(gate, k.shape(), op, "gate");
  a.cu = dsa_detail::read_cu_seqlens(cu_seqlens, a.T, op);
  a.cp = dsa_detail::pool_offsets(a.cu, a.P);
  a.NP = a.cp.back();
  a.k = k.contiguous(), a.gate = gate.contiguous(), a.ape = ape.contiguous();
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

template <class F>
void compress_fwd(const CompressArgs& a, Tensor& out) {
  const F* k = a.k.data<F>();
  const F* g = a.gate.data<F>();
  const F* ape = a.ape.data<F>();
  F* o = out.data<F>();
  const std::vector<int64_t> st = pool_starts(a);
  const int64_t P = a.P, D = a.D;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < a.NP; ++p) {
    std::vector<F> alpha(static_cast<size_t>(P));
    const int64_t s = st[size_t(p)];
    for (int64_t c = 0; c < D; ++c) {
      pool_alpha(g, ape, s, c, P, D, alpha.data());
      F acc = 0;
      for (int64_t j = 0; j < P; ++j) acc += alpha[size_t(j)] * k[(s + j) * D + c];
      o[p * D + c] = acc;
    }
  }
}

template <class F>
KPoolCompressGrads compress_bwd(const CompressArgs& a, const Tensor& d_in) {
  const Tensor dpool = d_in.contiguous();
  const F* k = a.k.data<F>();
  const F* g = a.gate.data<F>();
  const F* ape = a.ape.data<F>();
  const F* dK = dpool.data<F>();
  KPoolCompressGrads r;
  r.dk = Tensor::zeros({a.T, a.D}, a.k.dtype());
  r.dgate = Tensor::zeros({a.T, a.D}, a.k.dtype());
  r.dape = Tensor::zeros({a.P, a.D}, a.k.dtype());
  F* dk = r.dk.data<F>();
  F* dg = r.dgate.data<F>();
  F* dA = r.dape.data<F>();
  const std::vector<int64_t> st = pool_starts(a);
  const int64_t P = a.P, D = a.D;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < a.NP; ++p) {
    std::vector<F> alpha(static_cast<size_t>(P));
    const int64_t s = st[size_t(p)];
    for (int64_t c = 0; c < D; ++c) {
      pool_alpha(g, ape, s, c, P, D, alpha.data());
      F K = 0;
      for (int64_t j = 0; j < P; ++j) K += alpha[size_t(j)] * k[(s + j) * D + c];
      const F d = dK[p * D + c];
      for (int64_t j = 0; j < P; ++j) {
        dk[(s + j) * D + c] = alpha[size_t(j)] * d;
        dg[(s + j) * D + c] = alpha[size_t(j)] * (k[(s + j) * D + c] - K) * d;
      }
    }
  }
  // dape: per (slot, channel), the pools in id order.
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < D; ++c)
    for (int64_t p = 0; p < a.NP; ++p)
      for (int64_t j = 0; j < P; ++j) dA[j * D + c] += dg[(st[size_t(p)] + j) * D + c];
  return r;
}

void check_kp(int64_t K, int64_t P, const char* op) {
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  HLM_CHECK(K >= 1, "{}: K (index_topk) must be >= 1, got {}", op, K);
  HLM_CHECK(K % P == 0, "{}: K (index_topk = {}) must be divisible by the pool size P = {}", op, K,
            P);
}

template <class F>
void pool_target_dense(const Tensor& tt, const std::vector<int64_t>& cu, int64_t P, Tensor& out) {
  const F* x = tt.data<F>();
  F* o = out.data<F>();
  const int64_t Wt = tt.size(1), Wp = out.size(1);
  std::fill(o, o + out.numel(), F(0));
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
#pragma omp parallel for schedule(static)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      const int64_t n = (t - cu[d] + 1) / P;
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

Tensor kpool_pool_offsets(const Tensor& cu_seqlens, int64_t T, int64_t P) {
  HLM_CHECK(P >= 1, "kpool_pool_offsets: the pool size P must be >= 1, got {}", P);
  const std::vector<int64_t> cu = dsa_detail::read_cu_seqlens(cu_seqlens, T, "kpool_pool_offsets");
  return Tensor::from_vector<int64_t>({int64_t(cu.size())}, dsa_detail::pool_offsets(cu, P));
}

Tensor kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                      const Tensor& cu_seqlens) {
  const CompressArgs a = check_compress(k, gate, ape, cu_seqlens, "kpool_compress");
  Tensor out = Tensor::empty({a.NP, a.D}, a.k.dtype());
  if (a.k.dtype() == DType::f64)
    compress_fwd<double>(a, out);
  else
    compress_fwd<float>(a, out);
  return out;
}

KPoolCompressGrads kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                                           const Tensor& cu_seqlens, const Tensor& d_pooled) {
  const char* op = "kpool_compress_backward";
  const CompressArgs a = check_compress(k, gate, ape, cu_seqlens, op);
  detail::require_float(d_pooled, op, "d_pooled");
  detail::require_same_dtype(d_pooled, a.k, op, "d_pooled", "k");
  detail::require_shape(d_pooled, {a.NP, a.D}, op, "d_pooled");
  return a.k.dtype() == DType::f64 ? compress_bwd<double>(a, d_pooled)
                                   : compress_bwd<float>(a, d_pooled);
}

KPoolSelection kpool_select(const Tensor& pool_scores, const Tensor& cu_seqlens, int64_t K,
                            int64_t P, bool always_select_tail) {
  const char* op = "kpool_select";
  check_kp(K, P, op);
  detail::require_float(pool_scores, op, "pool_scores");
  HLM_CHECK(pool_scores.dim() == 2, "{}: pool_scores must be [T, W], got {}", op,
            pool_scores.describe());
  const int64_t T = pool_scores.size(0);
  const std::vector<int64_t> cu = dsa_detail::read_cu_seqlens(cu_seqlens, T, op);
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, P);
  const int64_t G = K / P;
  KPoolSelection sel;
  sel.pools = topk_select(pool_scores, cu_seqlens, G, P);
  const int64_t W = K + (always_select_tail ? P - 1 : 0);
  sel.indices = Tensor::empty({T, W}, DType::i32);
  const int32_t* pl = sel.pools.data<int32_t>();
  int32_t* o = sel.indices.data<int32_t>();
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
#pragma omp parallel for schedule(static)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      int32_t* row = o + t * W;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t p = pl[t * G + g];
        for (int64_t j = 0; j < P; ++j)
          row[g * P + j] = p < 0 ? -1 : int32_t(cu[d] + (p - cp[d]) * P + j);
      }
      if (always_select_tail) {
        const int64_t r = t - cu[d];
        const int64_t first = (r + 1) / P * P;  // relative start of the incomplete pool
        for (int64_t j = 0; j < P - 1; ++j)
          row[K + j] = first + j <= r ? int32_t(cu[d] + first + j) : -1;
      }
    }
  }
  return sel;
}

Tensor kpool_pool_target_dense(const Tensor& token_target, const Tensor& cu_seqlens, int64_t P,
                               int64_t Wp) {
  const char* op = "kpool_pool_target_dense";
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  detail::require_float(token_target, op, "token_target");
  HLM_CHECK(token_target.dim() == 2, "{}: token_target must be [T, W], got {}", op,
            token_target.describe());
  const int64_t T = token_target.size(0);
  const std::vector<int64_t> cu = dsa_detail::read_cu_seqlens(cu_seqlens, T, op);
  const int64_t need_t = dsa_detail::max_keys_per_doc(cu, 1);
  const int64_t need_p = dsa_detail::max_keys_per_doc(cu, P);
  HLM_CHECK(token_target.size(1) >= need_t, "{}: token_target needs W >= {} columns, got {}", op,
            need_t, token_target.describe());
  HLM_CHECK(Wp == 0 || Wp >= need_p, "{}: Wp must be 0 or >= {}, got {}", op, need_p, Wp);
  const Tensor tt = token_target.contiguous();
  Tensor out = Tensor::empty({T, Wp == 0 ? need_p : Wp}, tt.dtype());
  if (tt.dtype() == DType::f64)
    pool_target_dense<double>(tt, cu, P, out);
  else
    pool_target_dense<float>(tt, cu, P, out);
  return out;
}

Tensor kpool_pool_target_sparse(const Tensor& token_target, const Tensor& pools, int64_t P) {
  const char* op = "kpool_pool_target_sparse";
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  detail::require_float(token_target, op, "token_target");
  detail::require_index(pools, op, "pools");
  HLM_CHECK(pools.dim() == 2, "{}: pools must be [T, K / P], got {}", op, pools.describe());
  const int64_t T = pools.size(0), G = pools.size(1);
  HLM_CHECK(token_target.dim() == 2 && token_target.size(0) == T &&
                (token_target.size(1) == G * P || token_target.size(1) == G * P + P - 1),
            "{}: token_target must be [T = {}, K = {} or K + P - 1 = {}], got {}", op, T, G * P,
            G * P + P - 1, token_target.describe());
  const Tensor tt = token_target.contiguous();
  const std::vector<int64_t> pl = detail::index_values(pools);
  Tensor out = Tensor::empty({T, G}, tt.dtype());
  if (tt.dtype() == DType::f64)
    pool_target_sparse<double>(tt, pl, P, out);
  else
    pool_target_sparse<float>(tt, pl, P, out);
  return out;
}

}  // namespace hlm::ops
