// The front door of the cross-entropy (ops/cross_entropy.h): argument checks (every target),
// output allocation, and the switch to the CPU reference (ops/cpu/cross_entropy.cpp). No CUDA
// implementation yet.
#include "ops/cross_entropy.h"

#include "ops/cpu/cross_entropy.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
// Validates shapes, dtypes and every target; returns the targets as int64.
std::vector<int64_t> check_inputs(const char* op, const Tensor& logits, const Tensor& targets,
                                  int64_t ignore_index) {
  detail::require_real(logits, op, "logits");
  HLM_CHECK(logits.dim() == 2, "{}: logits must be [T, V], got {}", op, logits.describe());
  detail::require_int(targets, op, "targets");
  detail::require_shape(targets, {logits.size(0)}, op, "targets");
  detail::one_device(op, {logits, "logits"}, {{targets, "targets"}});
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
  out.row_loss = detail::new_output({nt}, logits.dtype(), logits.device());
  out.lse = detail::new_output({nt}, logits.dtype(), logits.device());
  detail::cpu_only(op, logits, "logits");
  cpu::cross_entropy_forward(logits, tg, out);
  return out;
}

Tensor cross_entropy_backward(const Tensor& logits_, const Tensor& targets,
                              const CrossEntropyResult& saved, double dloss) {
  constexpr const char* op = "cross_entropy_backward";
  const std::vector<int64_t> tg = check_inputs(op, logits_, targets, saved.ignore_index);
  detail::require_real_like(saved.lse, logits_, {logits_.size(0)}, op, "saved.lse", "logits");
  int64_t count = 0;
  for (int64_t t : tg) count += t != saved.ignore_index;
  HLM_CHECK(count == saved.count, "{}: saved.count {} does not match the targets ({} not ignored)",
            op, saved.count, count);
  const Tensor logits = logits_.contiguous(), lse = saved.lse.contiguous();
  Tensor dx = detail::new_output(logits.shape(), logits.dtype(), logits.device());
  detail::cpu_only(op, logits, "logits");
  cpu::cross_entropy_backward(logits, tg, lse, saved.ignore_index, count, dloss, dx);
  return dx;
}

}  // namespace hlm::ops
