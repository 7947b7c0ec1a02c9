// Cross-entropy on the CPU (ops/cross_entropy.h, the reference; entry points in
// ops/cpu/cross_entropy.h).
//   lse = m + log sum_v e^{x_v - m}, m = max_v x_v;  loss_t = lse - x_target
//   d loss_t / d x_v = softmax(x)_v - [v == target] = e^{x_v - lse} - [v == target]
#include "ops/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void cross_entropy_forward(const Tensor& logits, const std::vector<int64_t>& tg,
                           CrossEntropyResult& out) {
  const int64_t nt = logits.size(0), v = logits.size(1), ignore_index = out.ignore_index;
  out.count = 0;
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = logits.data<T>();
    T *pl = out.row_loss.data<T>(), *plse = out.lse.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      const T* xr = px + t * v;
      T m = xr[0];
      for (int64_t i = 1; i < v; ++i) m = std::max(m, xr[i]);
      T s = 0;
      for (int64_t i = 0; i < v; ++i) s += std::exp(xr[i] - m);
      const T lse = m + std::log(s);
      plse[t] = lse;
      pl[t] = tg[size_t(t)] == ignore_index ? T(0) : lse - xr[tg[size_t(t)]];
    }
    double sum = 0;  // token order, FP64
    for (int64_t t = 0; t < nt; ++t)
      if (tg[size_t(t)] != ignore_index) sum += double(pl[t]), ++out.count;
    out.loss = out.count > 0 ? sum / double(out.count) : 0.0;
  });
}

void cross_entropy_backward(const Tensor& logits, const std::vector<int64_t>& tg, const Tensor& lse,
                            int64_t ignore_index, int64_t count, double dloss, Tensor& dx) {
  const int64_t nt = logits.size(0), v = logits.size(1);
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *px = logits.data<T>(), *plse = lse.data<T>();
    T* pdx = dx.data<T>();
    const T scale = count > 0 ? T(dloss / double(count)) : T(0);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      T* dr = pdx + t * v;
      const int64_t target = tg[size_t(t)];
      if (target == ignore_index) {
        for (int64_t i = 0; i < v; ++i) dr[i] = T(0);
        continue;
      }
      for (int64_t i = 0; i < v; ++i) {
        const T p = std::exp(px[t * v + i] - plse[t]);
        dr[i] = scale * (p - (i == target ? T(1) : T(0)));
      }
    }
  });
}

}  // namespace hlm::ops::cpu
