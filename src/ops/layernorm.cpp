// The front door of LayerNorm (ops/layernorm.h): argument checks, output allocation, and the
// switch to the CPU reference (ops/cpu/layernorm.cpp) or the CUDA kernels (ops/cuda/norms.cu).
#include "ops/layernorm.h"

#include "ops/cpu/layernorm.h"
#include "ops/cuda/norms.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

// x [..., D] and the parameters w, b [D] (x's dtype, or f32 next to bf16 x) on x's device.
void check_common(const char* op, const Tensor& x, std::initializer_list<detail::Arg> params) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., D], got {}", op, x.describe());
  for (const detail::Arg& p : params) {
    detail::require_float_dev(p.t, op, p.name);
    detail::require_same_device(p.t, x, op, p.name, "x");
    detail::require_param_dtype(p.t, x, op, p.name);
    detail::require_shape(p.t, {x.size(-1)}, op, p.name);
  }
}

}  // namespace

LayerNormResult layernorm_forward(const Tensor& x_, const Tensor& w_, const Tensor& b_,
                                  double eps) {
  constexpr const char* op = "layernorm_forward";
  check_common(op, x_, {{w_, "w"}, {b_, "b"}});
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  const Tensor x = x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const Shape lead = detail::leading_shape(x);
  const DType cdt = detail::compute_dtype(x.dtype());
  const Device dev = x.device();
  LayerNormResult out{detail::new_output(x.shape(), x.dtype(), dev),
                      detail::new_output(lead, cdt, dev), detail::new_output(lead, cdt, dev)};
  HLM_DISPATCH(op, dev, layernorm_forward, x, w, b, eps, out);
  return out;
}

Tensor layernorm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                          const Tensor& mean_, const Tensor& rstd_, Tensor& dw, Tensor& db) {
  constexpr const char* op = "layernorm_backward";
  check_common(op, x_, {{w_, "w"}});
  detail::require_like_x(dy_, x_, x_.shape(), op, "dy");
  detail::require_compute_like(mean_, x_, detail::leading_shape(x_), op, "mean", "x");
  detail::require_rstd(rstd_, x_, op);
  detail::require_param_grad(dw, x_, {x_.size(-1)}, op, "dw");
  detail::require_param_grad(db, x_, {x_.size(-1)}, op, "db");
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               mean = mean_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), layernorm_backward, dy, x, w, mean, rstd, dx, dw, db);
  return dx;
}

}  // namespace hlm::ops
