// The CPU reference of the token picks (ops/token_pick.h): rows in parallel; each row's maximum
// and log-sum-exp in id order, and a sampled row's candidates sorted (logit descending, then id)
// with their weights summed in FP64 in that order.
#include "ops/cpu/token_pick.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace hlm::ops::cpu {

namespace {

// A row's arg max (ties: the lower id), first non-finite id (then nothing else is computed) and
// log-sum-exp, in id order.
struct RowStats {
  int64_t best = 0, bad = -1;
  double mx = 0, lse = 0;
};
template <class T>
RowStats stats(const T* x, int64_t V) {
  RowStats st;
  for (int64_t v = 0; v < V; ++v) {
    if (!std::isfinite(x[v])) {
      st.bad = v;
      return st;
    }
    if (x[v] > x[st.best]) st.best = v;
  }
  st.mx = double(x[st.best]);
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - st.mx);
  st.lse = st.mx + std::log(s);
  return st;
}

}  // namespace

template <class T>
RowPick score_row(const T* x, int64_t V, int64_t token) {
  const RowStats st = stats(x, V);
  RowPick r;
  r.token = token;
  r.bad = st.bad;
  if (st.bad < 0) r.logprob = double(x[token]) - st.lse;
  return r;
}

template <class T>
RowPick pick_row(const T* x, int64_t V, const SampleRow& p) {
  const RowStats st = stats(x, V);
  RowPick r;
  r.bad = st.bad;
  if (st.bad >= 0) return r;
  const double mx = st.mx, lse = st.lse;
  r.token = st.best;
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
template RowPick score_row<float>(const float*, int64_t, int64_t);
template RowPick score_row<double>(const double*, int64_t, int64_t);

namespace {

template <class T>
void rows(const T* x, int64_t R, int64_t V, const SampleRow* p, const int64_t* given,
          TokenPick& out) {
  auto* token = out.token.data<int64_t>();
  auto* logprob = out.logprob.data<double>();
  auto* bad = out.bad.data<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (R > 1 && R * V > 65536)
  for (int64_t r = 0; r < R; ++r) {
    const RowPick k =
        given ? score_row(x + r * V, V, given[r]) : pick_row(x + r * V, V, p ? p[r] : SampleRow{});
    token[r] = k.token;
    logprob[r] = k.logprob;
    bad[r] = k.bad;
  }
}

void dispatch(const Tensor& logits, const SampleRow* p, const int64_t* given, TokenPick& out) {
  const int64_t R = logits.size(0), V = logits.size(1);
  if (logits.dtype() == DType::f64)
    rows(logits.data<double>(), R, V, p, given, out);
  else
    rows(logits.data<float>(), R, V, p, given, out);
}

}  // namespace

void greedy_pick(const Tensor& logits, TokenPick& out) {
  dispatch(logits, nullptr, nullptr, out);
}

void sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows, TokenPick& out) {
  dispatch(logits, rows.data(), nullptr, out);
}

void score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens, TokenPick& out) {
  dispatch(logits, nullptr, tokens.data(), out);
}

}  // namespace hlm::ops::cpu
