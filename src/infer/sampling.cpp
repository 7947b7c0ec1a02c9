#include "infer/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace hlm::infer {

void SamplingParams::validate() const {
  HLM_CHECK(std::isfinite(temperature) && temperature >= 0,
            "sampling: temperature must be 0 (greedy) or a finite positive number, got {}",
            temperature);
  HLM_CHECK(top_k >= 0, "sampling: top_k must be 0 (off) or >= 1, got {}", top_k);
  HLM_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1,
            "sampling: top_p must be in (0, 1], got {}", top_p);
}

namespace {

// log sum_v exp(x_v) in FP64, with mx = max_v x_v subtracted.
double log_sum_exp(const float* x, int64_t V, double mx) {
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - mx);
  return mx + std::log(s);
}

}  // namespace

Sampled sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t stream,
                     uint64_t step) {
  p.validate();
  HLM_CHECK(V >= 1, "sampling: the vocabulary is empty");
  int64_t best = 0;
  for (int64_t v = 0; v < V; ++v) {
    HLM_CHECK(std::isfinite(logits[v]), "sampling: logit {} of token {} is not finite", logits[v],
              v);
    if (logits[v] > logits[best]) best = v;
  }
  const double mx = logits[best];
  Sampled r;
  const double lse = log_sum_exp(logits, V, mx);
  if (p.greedy()) {
    r.token = best;
    r.logprob = double(logits[best]) - lse;
    return r;
  }
  // Candidates in decreasing q (ties: lower id first); q_v proportional to exp((l_v - max) / t).
  std::vector<int64_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), int64_t(0));
  const auto before = [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  if (k < V) {
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
    ids.resize(static_cast<size_t>(k));
  } else {
    std::sort(ids.begin(), ids.end(), before);
  }
  std::vector<double> w(ids.size());
  double total = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    w[i] = std::exp((double(logits[ids[i]]) - mx) / p.temperature);
    total += w[i];
  }
  size_t keep = ids.size();
  if (p.top_p < 1.0) {
    double run = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      run += w[i];
      if (run >= p.top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += w[i];
  Rng rng(p.seed, stream);
  rng.set_counter(step);
  const double u = rng.uniform() * kept;
  size_t pick = keep - 1;  // u < kept: the loop ends before unless rounding leaves a sliver
  double run = 0;
  for (size_t i = 0; i < keep; ++i) {
    run += w[i];
    if (u < run) {
      pick = i;
      break;
    }
  }
  r.token = ids[pick];
  r.logprob = double(logits[r.token]) - lse;
  return r;
}

}  // namespace hlm::infer
