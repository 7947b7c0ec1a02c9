// The CPU reference of the token picks (ops/token_pick.h): rows in parallel; each row's maximum
// and log-sum-exp in id order, and a sampled row's candidates sorted (logit descending, then id)
// with their weights summed in FP64 in that order.
#include "ops/cpu/token_pick.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace hlm::ops::cpu {

template <class T>
RowPick pick_row(const T* x, int64_t V, const SampleRow& p) {
  RowPick r;
  int64_t best = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (!std::isfinite(x[v])) {
      r.bad = v;
      return r;
    }
    if (x[v] > x[best]) best = v;
  }
  const double mx = double(x[best]);
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - mx);
  const double lse = mx + std::log(s);
  r.token = best;
  if (p.temperature > 0) {
    // Candidates in decreasing q (ties: lower id first); q_v proportional to exp((x_v - m) / t).
    std::vector<int64_t> ids(static_cast<size_t>(V));
    std::iota(ids.begin(), ids.end(), int64_t(0));
    const auto before = [&](int64_t a, int64_t b) {
      return x[a] > x[b] || (x[a] == x[b] && a < b);
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
      w[i] = std::exp((double(x[ids[i]]) - mx) / p.temperature);
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
    const double u = p.u * kept;
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
  }
  r.logprob = double(x[r.token]) - lse;
  return r;
}

template RowPick pick_row<float>(const float*, int64_t, const SampleRow&);
template RowPick pick_row<double>(const double*, int64_t, const SampleRow&);

namespace {

template <class T>
void rows(const T* x, int64_t R, int64_t V, const SampleRow* p, TokenPick& out) {
  auto* token = out.token.data<int64_t>();
  auto* logprob = out.logprob.data<double>();
  auto* bad = out.bad.data<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (R > 1 && R * V > 65536)
  for (int64_t r = 0; r < R; ++r) {
    const RowPick k = pick_row(x + r * V, V, p ? p[r] : SampleRow{});
    token[r] = k.token;
    logprob[r] = k.logprob;
    bad[r] = k.bad;
  }
}

void dispatch(const Tensor& logits, const SampleRow* p, TokenPick& out) {
  const int64_t R = logits.size(0), V = logits.size(1);
  if (logits.dtype() == DType::f64)
    rows(logits.data<double>(), R, V, p, out);
  else
    rows(logits.data<float>(), R, V, p, out);
}

}  // namespace

void greedy_pick(const Tensor& logits, TokenPick& out) {
  dispatch(logits, nullptr, out);
}

void sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows, TokenPick& out) {
  dispatch(logits, rows.data(), out);
}

}  // namespace hlm::ops::cpu
