// The front door of LayerNorm (ops/layernorm.h): argument checks, output allocation, and the
// switch to the CPU reference (ops/cpu/layernorm.cpp). No CUDA implementation yet.
#include "ops/layernorm.h"

#include "ops/cpu/layernorm.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
// x [..., D] and the [D] vectors `vs` (w, b; dw, db) of x's dtype on x's device.
void check_rows(const char* op, const Tensor& x, std::initializer_list<detail::Arg> vs) {
  detail::require_real(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., D], got {}", op, x.describe());
  for (const detail::Arg& v : vs) detail::require_real_like(v.t, x, {x.size(-1)}, op, v.name, "x");
}
}  // namespace

LayerNormResult layernorm_forward(const Tensor& x_, const Tensor& w_, const Tensor& b_,
                                  double eps) {
  constexpr const char* op = "layernorm_forward";
  check_rows(op, x_, {{w_, "w"}, {b_, "b"}});
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  const Tensor x = x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const Shape lead = detail::leading_shape(x);
  const Device dev = x.device();
  LayerNormResult out{detail::new_output(x.shape(), x.dtype(), dev),
                      detail::new_output(lead, x.dtype(), dev),
                      detail::new_output(lead, x.dtype(), dev)};
  detail::cpu_only(op, x, "x");
  cpu::layernorm_forward(x, w, b, eps, out);
  return out;
}

Tensor layernorm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                          const Tensor& mean_, const Tensor& rstd_, Tensor& dw, Tensor& db) {
  constexpr const char* op = "layernorm_backward";
  check_rows(op, x_, {{w_, "w"}, {dw, "dw"}, {db, "db"}});
  detail::require_contiguous(dw, op, "dw");
  detail::require_contiguous(db, op, "db");
  detail::require_real_like(dy_, x_, x_.shape(), op, "dy", "x");
  detail::require_real_like(mean_, x_, detail::leading_shape(x_), op, "mean", "x");
  detail::require_real_like(rstd_, x_, detail::leading_shape(x_), op, "rstd", "x");
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               mean = mean_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = detail::new_output(x.shape(), x.dtype(), x.device());
  detail::cpu_only(op, x, "x");
  cpu::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
  return dx;
}

}  // namespace hlm::ops
