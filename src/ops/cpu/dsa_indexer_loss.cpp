// CPU reference of the DSA indexer KL loss and its attention target (see ops/dsa_indexer_loss.h).
#include <cmath>
#include <limits>

#include "ops/dsa_common.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

using dsa_detail::Pattern;

template <class F>
inline F dotp(const F* a, const F* b, int64_t n) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <class F>
void target_rows(const Tensor& qc, const Tensor& kvc, const Pattern& p, F scale, Tensor& out) {
  const F* q = qc.data<F>();
  const F* kv = kvc.data<F>();
  F* o = out.data<F>();
  const int64_t H = qc.size(1), D = qc.size(2), W = p.W;
  std::fill(o, o + out.numel(), F(0));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t e0 = p.row_ptr[size_t(t)], n = p.row_ptr[size_t(t + 1)] - e0;
    if (n == 0) continue;
    std::vector<F> l(static_cast<size_t>(n)), acc(static_cast<size_t>(n), F(0));
    for (int64_t h = 0; h < H; ++h) {
      const F* qr = q + (t * H + h) * D;
      F m = -std::numeric_limits<F>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        l[size_t(j)] = scale * dotp(qr, kv + p.key[size_t(e0 + j)] * D, D);
        m = std::max(m, l[size_t(j)]);
      }
      F sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += (l[size_t(j)] = std::exp(l[size_t(j)] - m));
      for (int64_t j = 0; j < n; ++j) acc[size_t(j)] += l[size_t(j)] / sum;
    }
    F tot = 0;
    for (int64_t j = 0; j < n; ++j) tot += acc[size_t(j)];
    for (int64_t j = 0; j < n; ++j) o[t * W + p.slot[size_t(e0 + j)]] = acc[size_t(j)] / tot;
  }
}

Tensor run_target(const Tensor& q, const Tensor& kv, const Pattern& p, double scale) {
  const Tensor qc = q.contiguous(), kvc = kv.contiguous();
  Tensor out = Tensor::empty({p.T, p.W}, q.dtype());
  if (q.dtype() == DType::f64)
    target_rows<double>(qc, kvc, p, scale, out);
  else
    target_rows<float>(qc, kvc, p, float(scale), out);
  return out;
}

std::vector<int64_t> check_target(const Tensor& q, const Tensor& kv, const Tensor& cu_seqlens,
                                  double scale, const char* op) {
  detail::require_float(q, op, "q");
  detail::require_float(kv, op, "kv");
  detail::require_same_dtype(kv, q, op, "kv", "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H, D_qk], got {}", op, q.describe());
  detail::require_shape(kv, {q.size(0), q.size(2)}, op, "kv (the latent cache rows [T, D_qk])");
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  return dsa_detail::read_cu_seqlens(cu_seqlens, q.size(0), op);
}

template <class F>
IndexerKl kl_rows(const Tensor& sc, const Tensor& tg, double coeff, KlReduction red) {
  const F* s = sc.data<F>();
  const F* p = tg.data<F>();
  const int64_t T = sc.size(0), W = sc.size(1);
  const F eps = F(kIndexerKlEps);
  const F ninf = -std::numeric_limits<F>::infinity();
  IndexerKl r;
  r.d_scores = Tensor::zeros({T, W}, sc.dtype());
  F* d = r.d_scores.data<F>();
  std::vector<double> row_loss(size_t(T), 0.0);
  std::vector<char> row_used(size_t(T), 0);
  std::vector<char> bad(size_t(T), 0);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* sr = s + t * W;
    const F* pr = p + t * W;
    F m = ninf;
    int64_t n = 0;
    for (int64_t j = 0; j < W; ++j) {
      if (sr[j] == ninf) {
        if (pr[j] != F(0)) bad[size_t(t)] = 1;
        continue;
      }
      ++n;
      m = std::max(m, sr[j]);
    }
    if (n == 0) continue;
    row_used[size_t(t)] = 1;
    F sum = 0;
    for (int64_t j = 0; j < W; ++j)
      if (sr[j] != ninf) sum += std::exp(sr[j] - m);
    F loss = 0, c = 0;
    for (int64_t j = 0; j < W; ++j) {
      if (sr[j] == ninf) continue;
      const F pi = std::exp(sr[j] - m) / sum;
      loss += pr[j] * (std::log(pr[j] + eps) - std::log(pi + eps));
      c += pr[j] * pi / (pi + eps);
      d[t * W + j] = pi;  // stash pi
    }
    row_loss[size_t(t)] = double(loss);
    for (int64_t j = 0; j < W; ++j) {
      if (sr[j] == ninf) continue;
      const F pi = d[t * W + j];
      d[t * W + j] = pi * c - pr[j] * pi / (pi + eps);
    }
  }
  for (int64_t t = 0; t < T; ++t)
    HLM_CHECK(!bad[size_t(t)],
              "indexer_kl_loss: target row {} has mass where the score is -inf (outside the "
              "row's set): scores and target must come from the same layout",
              t);
  double total = 0;
  for (int64_t t = 0; t < T; ++t) {
    total += row_loss[size_t(t)];
    r.rows += row_used[size_t(t)];
  }
  const double g = red == KlReduction::sum ? coeff : (r.rows ? coeff / double(r.rows) : 0.0);
  r.loss = g * total;
  const F gf = F(g);
  for (int64_t i = 0; i < T * W; ++i) d[i] *= gf;
  return r;
}

}  // namespace

Tensor attention_target(const Tensor& q, const Tensor& kv, const Tensor& cu_seqlens, double scale,
                        int64_t W) {
  const char* op = "attention_target";
  const std::vector<int64_t> cu = check_target(q, kv, cu_seqlens, scale, op);
  const int64_t need = dsa_detail::max_keys_per_doc(cu, 1);
  HLM_CHECK(W == 0 || W >= need, "{}: W must be 0 or >= {} (the longest document), got {}", op,
            need, W);
  return run_target(q, kv, dsa_detail::causal_pattern(cu, 1, W == 0 ? need : W), scale);
}

Tensor attention_target_at(const Tensor& q, const Tensor& kv, const Tensor& cu_seqlens,
                           const Tensor& indices, double scale) {
  const char* op = "attention_target_at";
  const std::vector<int64_t> cu = check_target(q, kv, cu_seqlens, scale, op);
  return run_target(q, kv, dsa_detail::rows_pattern(indices, cu, 1, op, "indices"), scale);
}

IndexerKl indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff,
                          KlReduction reduction) {
  const char* op = "indexer_kl_loss";
  detail::require_float(scores, op, "scores");
  detail::require_float(target, op, "target");
  detail::require_same_dtype(target, scores, op, "target", "scores");
  HLM_CHECK(scores.dim() == 2, "{}: scores must be [T, W], got {}", op, scores.describe());
  detail::require_shape(target, scores.shape(), op, "target");
  HLM_CHECK(std::isfinite(coeff), "{}: coeff must be finite, got {}", op, coeff);
  const Tensor sc = scores.contiguous(), tg = target.contiguous();
  return scores.dtype() == DType::f64 ? kl_rows<double>(sc, tg, coeff, reduction)
                                      : kl_rows<float>(sc, tg, coeff, reduction);
}

}  // namespace hlm::ops
