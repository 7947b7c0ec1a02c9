// The CPU reference of the greedy pick (ops/greedy.h): rows in parallel, each row in id order (the
// loops of infer::sample_token, so the same bits).
#include "ops/cpu/greedy.h"

#include <cmath>

namespace hlm::ops::cpu {
namespace {

template <class T>
void rows(const T* x, int64_t R, int64_t V, int64_t* token, double* logprob, int64_t* bad) {
#pragma omp parallel for schedule(static) if (R > 1 && R * V > 65536)
  for (int64_t r = 0; r < R; ++r) {
    const T* row = x + r * V;
    int64_t best = 0, first_bad = -1;
    for (int64_t v = 0; v < V; ++v) {
      if (!std::isfinite(row[v])) {
        first_bad = v;
        break;
      }
      if (row[v] > row[best]) best = v;
    }
    token[r] = best;
    bad[r] = first_bad;
    logprob[r] = 0;
    if (first_bad >= 0) continue;
    const double mx = double(row[best]);
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(row[v]) - mx);
    logprob[r] = mx - (mx + std::log(s));
  }
}

}  // namespace

void greedy_pick(const Tensor& logits, GreedyPick& out) {
  const int64_t R = logits.size(0), V = logits.size(1);
  auto* t = out.token.data<int64_t>();
  auto* lp = out.logprob.data<double>();
  auto* b = out.bad.data<int64_t>();
  if (logits.dtype() == DType::f64)
    rows(logits.data<double>(), R, V, t, lp, b);
  else
    rows(logits.data<float>(), R, V, t, lp, b);
}

}  // namespace hlm::ops::cpu
