// Cross-entropy on the CPU (ops/cross_entropy.h).
//   lse = m + log sum_v e^{x_v - m}, m = max_v x_v;  loss_t = lse - x_target
//   d loss_t / d x_v = softmax(x)_v - [v == target] = e^{x_v - lse} - [v == target]
#include "ops/cross_entropy.h"

#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
// Validates shapes, dtypes and every target; returns the targets as int64.
std::vector<int64_t> check_inputs(const char* op, const Tensor& logits, const Tensor& targets,
                                  int64_t ignore_index) {
  detail::require_float(logits, op, "logits");
  HLM_CHECK(logits.dim() == 2, "{}: logits must be [T, V], got {}", op, logits.describe());
  detail::require_index(targets, op, "targets");
  detail::require_shape(targets, {logits.size(0)}, op, "targets");
  const int64_t v = logits.size(1);
  std::vector<int64_t> tg = detail::index_values(targets);
  for (size_t t = 0; t < tg.size(); ++t)
    HLM_CHECK(tg[t] == ignore_index || (tg[t] >= 0 && tg[t] < v),
              "{}: targets[{}] = {} is outside the vocabulary [0, {}) and is not ignore_index {}",
              op, t, tg[t], v, ignore_index);
  return tg;
}
}  // namespace

CrossEntropyResult cross_entropy_forward(const Tensor& logits_, const Tensor& targets,
                                         int64_t ignore_index) {
  constexpr const char* op = "cross_entropy_forward";
  const std::vector<int64_t> tg = check_inputs(op, logits_, targets, ignore_index);
  const Tensor logits = logits_.contiguous();
  const int64_t nt = logits.size(0), v = logits.size(1);
  HLM_CHECK(v > 0 || nt == 0, "{}: logits must have V >= 1 classes, got {}", op, logits.describe());
  CrossEntropyResult out;
  out.ignore_index = ignore_index;
  out.row_loss = Tensor::empty({nt}, logits.dtype());
  out.lse = Tensor::empty({nt}, logits.dtype());
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
  return out;
}

Tensor cross_entropy_backward(const Tensor& logits_, const Tensor& targets,
                              const CrossEntropyResult& saved, double dloss) {
  constexpr const char* op = "cross_entropy_backward";
  const std::vector<int64_t> tg = check_inputs(op, logits_, targets, saved.ignore_index);
  detail::require_float(saved.lse, op, "saved.lse");
  detail::require_same_dtype(saved.lse, logits_, op, "saved.lse", "logits");
  detail::require_shape(saved.lse, {logits_.size(0)}, op, "saved.lse");
  const Tensor logits = logits_.contiguous(), lse = saved.lse.contiguous();
  const int64_t nt = logits.size(0), v = logits.size(1);
  int64_t count = 0;
  for (int64_t t : tg) count += t != saved.ignore_index;
  HLM_CHECK(count == saved.count, "{}: saved.count {} does not match the targets ({} not ignored)",
            op, saved.count, count);
  Tensor dx = Tensor::empty({nt, v}, logits.dtype());
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *px = logits.data<T>(), *plse = lse.data<T>();
    T* pdx = dx.data<T>();
    const T scale = count > 0 ? T(dloss / double(count)) : T(0);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      T* dr = pdx + t * v;
      const int64_t target = tg[size_t(t)];
      if (target == saved.ignore_index) {
        for (int64_t i = 0; i < v; ++i) dr[i] = T(0);
        continue;
      }
      for (int64_t i = 0; i < v; ++i) {
        const T p = std::exp(px[t * v + i] - plse[t]);
        dr[i] = scale * (p - (i == target ? T(1) : T(0)));
      }
    }
  });
  return dx;
}

}  // namespace hlm::ops
