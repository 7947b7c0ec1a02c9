// The DSA indexer KL loss and its attention target on the CPU (ops/dsa_indexer_loss.h, the
// reference; entry points in ops/cpu/dsa_indexer_loss.h).
#include "ops/cpu/dsa_indexer_loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace hlm::ops::cpu {
namespace {

using dsa_detail::dot;
using dsa_detail::Pattern;

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
        l[size_t(j)] = scale * dot(qr, kv + p.key[size_t(e0 + j)] * D, D);
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

template <class F>
void kl_rows(const Tensor& sc, const Tensor& tg, double coeff, KlReduction red, IndexerKl& r) {
  const F* s = sc.data<F>();
  const F* p = tg.data<F>();
  const int64_t T = sc.size(0), W = sc.size(1);
  const F eps = F(kIndexerKlEps);
  const F ninf = -std::numeric_limits<F>::infinity();
  r.d_scores.zero_();
  r.rows = 0;
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
}

}  // namespace

void attention_target(const Tensor& q, const Tensor& kv, const Pattern& p, double scale,
                      Tensor& out) {
  if (q.dtype() == DType::f64)
    target_rows<double>(q, kv, p, scale, out);
  else
    target_rows<float>(q, kv, p, float(scale), out);
}

void indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff,
                     KlReduction reduction, IndexerKl& r) {
  if (scores.dtype() == DType::f64)
    kl_rows<double>(scores, target, coeff, reduction, r);
  else
    kl_rows<float>(scores, target, coeff, reduction, r);
}

}  // namespace hlm::ops::cpu
