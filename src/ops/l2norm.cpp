// The front door of the L2 normalisation (ops/l2norm.h): argument checks, output allocation, and
// the switch to the CPU reference (ops/cpu/l2norm.cpp) or the CUDA kernels (ops/cuda/norms.cu).
#include "ops/l2norm.h"

#include "ops/cpu/l2norm.h"
#include "ops/cuda/norms.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

L2NormResult l2norm_forward(const Tensor& x_, double eps) {
  constexpr const char* op = "l2norm_forward";
  detail::require_float_dev(x_, op, "x");
  HLM_CHECK(x_.dim() >= 1, "{}: x must be [..., D], got {}", op, x_.describe());
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  const Tensor x = x_.contiguous();
  const Device dev = x.device();
  L2NormResult out{
      detail::new_output(x.shape(), x.dtype(), dev),
      detail::new_output(detail::leading_shape(x), detail::compute_dtype(x.dtype()), dev)};
  HLM_DISPATCH(op, dev, l2norm_forward, x, eps, out.y, out.rstd);
  return out;
}

Tensor l2norm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& rstd_) {
  constexpr const char* op = "l2norm_backward";
  detail::require_float_dev(x_, op, "x");
  HLM_CHECK(x_.dim() >= 1, "{}: x must be [..., D], got {}", op, x_.describe());
  detail::require_like_x(dy_, x_, x_.shape(), op, "dy");
  detail::require_rstd(rstd_, x_, op);
  const Tensor x = x_.contiguous(), dy = dy_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), l2norm_backward, dy, x, rstd, dx);
  return dx;
}

}  // namespace hlm::ops
