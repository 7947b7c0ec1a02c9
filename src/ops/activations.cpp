// The front door of the elementwise activations (ops/activations.h): argument checks, output
// allocation, and the switch to the CPU reference (ops/cpu/activations.cpp) or the CUDA kernels
// (ops/cuda/activations.cu).
#include "ops/activations.h"

#include "ops/cpu/activations.h"
#include "ops/cuda/activations.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

Tensor forward(ActKind a, const char* op, const Tensor& x_) {
  detail::require_float_dev(x_, op, "x");
  const Tensor x = x_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), activation_forward, a, x, y);
  return y;
}

Tensor backward(ActKind a, const char* op, const Tensor& x_, const Tensor& dy_) {
  detail::require_float_dev(x_, op, "x");
  detail::require_like_x(dy_, x_, x_.shape(), op, "dy");
  const Tensor x = x_.contiguous(), dy = dy_.contiguous();
  Tensor dx = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), activation_backward, a, x, dy, dx);
  return dx;
}

}  // namespace

Tensor sigmoid_forward(const Tensor& x) {
  return forward(ActKind::sigmoid, "sigmoid_forward", x);
}
Tensor sigmoid_backward(const Tensor& x, const Tensor& dy) {
  return backward(ActKind::sigmoid, "sigmoid_backward", x, dy);
}
Tensor silu_forward(const Tensor& x) {
  return forward(ActKind::silu, "silu_forward", x);
}
Tensor silu_backward(const Tensor& x, const Tensor& dy) {
  return backward(ActKind::silu, "silu_backward", x, dy);
}
Tensor softplus_forward(const Tensor& x) {
  return forward(ActKind::softplus, "softplus_forward", x);
}
Tensor softplus_backward(const Tensor& x, const Tensor& dy) {
  return backward(ActKind::softplus, "softplus_backward", x, dy);
}

}  // namespace hlm::ops
