// The front door of the softmax (ops/softmax.h): argument checks, output allocation, and the
// switch to the CPU reference (ops/cpu/softmax.cpp). No CUDA implementation yet.
#include "ops/softmax.h"

#include "ops/cpu/softmax.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

Tensor softmax_forward(const Tensor& x_) {
  constexpr const char* op = "softmax_forward";
  detail::require_real(x_, op, "x");
  HLM_CHECK(x_.dim() >= 1, "{}: x must be [..., D], got {}", op, x_.describe());
  const Tensor x = x_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  detail::cpu_only(op, x, "x");
  cpu::softmax_forward(x, y);
  return y;
}

Tensor softmax_backward(const Tensor& y_, const Tensor& dy_) {
  constexpr const char* op = "softmax_backward";
  detail::require_real(y_, op, "y");
  HLM_CHECK(y_.dim() >= 1, "{}: y must be [..., D], got {}", op, y_.describe());
  detail::require_real_like(dy_, y_, y_.shape(), op, "dy", "y");
  const Device dev = y_.device();
  const Tensor y = y_.contiguous(), dy = dy_.contiguous();
  Tensor dx = detail::new_output(y.shape(), y.dtype(), dev);
  detail::cpu_only(op, y, "y");
  cpu::softmax_backward(y, dy, dx);
  return dx;
}

}  // namespace hlm::ops
