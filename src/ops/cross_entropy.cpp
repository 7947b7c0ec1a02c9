// The front door of the cross-entropy (ops/cross_entropy.h): argument checks (every target: on the
// host for CPU targets, on the device for CUDA targets), output allocation, and the switch to the
// CPU reference (ops/cpu/cross_entropy.cpp) or the CUDA kernels (ops/cuda/cross_entropy.cu).
#include "ops/cross_entropy.h"

#include "ops/cpu/cross_entropy.h"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/index_check.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
// The checked targets: on the CPU, every value as int64; on CUDA, the contiguous device tensor.
// count: the targets that are not ignore_index.
struct Targets {
  std::vector<int64_t> host;
  Tensor dev;
  int64_t count = 0;
};

[[noreturn]] void bad_target(const char* op, int64_t pos, int64_t value, int64_t v,
                             int64_t ignore_index) {
  HLM_FAIL("{}: targets[{}] = {} is outside the vocabulary [0, {}) and is not ignore_index {}", op,
           pos, value, v, ignore_index);
}

// Validates shapes, dtypes and every target.
Targets check_inputs(const char* op, const Tensor& logits, const Tensor& targets,
                     int64_t ignore_index) {
  HLM_CHECK(logits.defined(), "{}: logits is undefined", op);
  if (logits.device() == Device::cpu) {
    detail::require_real(logits, op, "logits");
  } else {
    HLM_CHECK(logits.dtype() == DType::f32 || logits.dtype() == DType::f64 ||
                  logits.dtype() == DType::bf16,
              "{}: logits must be f32, f64 or bf16 on CUDA, got {}", op, logits.describe());
  }
  HLM_CHECK(logits.dim() == 2, "{}: logits must be [T, V], got {}", op, logits.describe());
  detail::require_int(targets, op, "targets");
  detail::require_shape(targets, {logits.size(0)}, op, "targets");
  detail::one_device(op, {logits, "logits"}, {{targets, "targets"}});
  const int64_t v = logits.size(1);
  Targets tg;
  if (logits.device() != Device::cpu) {
    HLM_CUDA_PATH(op, {
      tg.dev = targets.contiguous();
      const cuda::IndexScan s = cuda::scan_indices(tg.dev, v, true, ignore_index);
      if (s.first_bad >= 0) bad_target(op, s.first_bad, s.bad_value, v, ignore_index);
      tg.count = s.kept;
    });
    return tg;
  }
  tg.host = detail::index_values(targets);
  for (size_t t = 0; t < tg.host.size(); ++t) {
    const int64_t x = tg.host[t];
    if (x == ignore_index) continue;
    if (x < 0 || x >= v) bad_target(op, int64_t(t), x, v, ignore_index);
    ++tg.count;
  }
  return tg;
}
}  // namespace

CrossEntropyResult cross_entropy_forward(const Tensor& logits_, const Tensor& targets,
                                         int64_t ignore_index) {
  constexpr const char* op = "cross_entropy_forward";
  const Targets tg = check_inputs(op, logits_, targets, ignore_index);
  const Tensor logits = logits_.contiguous();
  const int64_t nt = logits.size(0), v = logits.size(1);
  HLM_CHECK(v > 0 || nt == 0, "{}: logits must have V >= 1 classes, got {}", op, logits.describe());
  CrossEntropyResult out;
  out.ignore_index = ignore_index;
  const DType sdt = detail::compute_dtype(logits.dtype());  // the logits' dtype on the CPU
  out.row_loss = detail::new_output({nt}, sdt, logits.device());
  out.lse = detail::new_output({nt}, sdt, logits.device());
  if (logits.device() == Device::cpu) {
    cpu::cross_entropy_forward(logits, tg.host, out);
  } else {
    HLM_CUDA_PATH(op, cuda::cross_entropy_forward(logits, tg.dev, tg.count, out));
  }
  return out;
}

Tensor cross_entropy_backward(const Tensor& logits_, const Tensor& targets,
                              const CrossEntropyResult& saved, double dloss, int64_t mean_count) {
  constexpr const char* op = "cross_entropy_backward";
  const Targets tg = check_inputs(op, logits_, targets, saved.ignore_index);
  if (logits_.device() == Device::cpu)
    detail::require_real_like(saved.lse, logits_, {logits_.size(0)}, op, "saved.lse", "logits");
  else
    detail::require_compute_like(saved.lse, logits_, {logits_.size(0)}, op, "saved.lse", "logits");
  HLM_CHECK(tg.count == saved.count,
            "{}: saved.count {} does not match the targets ({} not ignored)", op, saved.count,
            tg.count);
  HLM_CHECK(mean_count == 0 || mean_count >= tg.count,
            "{}: mean_count must be 0 or at least the rows' count of targets ({}), got {}", op,
            tg.count, mean_count);
  const int64_t count = mean_count > 0 ? mean_count : tg.count;
  const Tensor logits = logits_.contiguous(), lse = saved.lse.contiguous();
  Tensor dx = detail::new_output(logits.shape(), logits.dtype(), logits.device());
  if (logits.device() == Device::cpu) {
    cpu::cross_entropy_backward(logits, tg.host, lse, saved.ignore_index, count, dloss, dx);
  } else {
    HLM_CUDA_PATH(op, cuda::cross_entropy_backward(logits, tg.dev, lse, saved.ignore_index, count,
                                                   dloss, dx));
  }
  return dx;
}

}  // namespace hlm::ops
