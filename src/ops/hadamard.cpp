// The front door of the Hadamard rotation (ops/hadamard.h): argument checks, output allocation,
// and the switch to the CPU reference (ops/cpu/hadamard.cpp) or the CUDA kernels
// (ops/cuda/hadamard.cu).
#include "ops/hadamard.h"

#include "ops/cpu/hadamard.h"
#include "ops/cuda/hadamard.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
void check(const char* op, const Tensor& x) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., d], got {}", op, x.describe());
  const int64_t d = x.size(-1);
  HLM_CHECK(d >= 1 && (d & (d - 1)) == 0, "{}: the last dimension must be a power of two, got {}",
            op, x.describe());
}
}  // namespace

Tensor hadamard(const Tensor& x_) {
  constexpr const char* op = "hadamard";
  check(op, x_);
  const Tensor x = x_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), hadamard, x, y);
  return y;
}

void hadamard_inplace(Tensor& x) {
  constexpr const char* op = "hadamard_inplace";
  check(op, x);
  detail::require_contiguous(x, op, "x");
  HLM_DISPATCH(op, x.device(), hadamard, x, x);
}

}  // namespace hlm::ops
