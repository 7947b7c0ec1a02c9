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
  for (const detail::Arg& v : vs) {
    detail::require_real(v.t, op, v.name);
    detail::require_same_dtype(v.t, x, op, v.name, "x");
    detail::require_same_device(v.t, x, op, v.name, "x");
    detail::require_shape(v.t, {x.size(-1)}, op, v.name);
  }
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
  switch (dev) {
    case Device::cpu:
      cpu::layernorm_forward(x, w, b, eps, out);
      break;
    case Device::cuda:
      detail::no_cuda_yet(op, x, "x");
  }
  return out;
}

Tensor layernorm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                          const Tensor& mean_, const Tensor& rstd_, Tensor& dw, Tensor& db) {
  constexpr const char* op = "layernorm_backward";
  check_rows(op, x_, {{w_, "w"}, {dw, "dw"}, {db, "db"}});
  detail::require_contiguous(dw, op, "dw");
  detail::require_contiguous(db, op, "db");
  detail::require_real(dy_, op, "dy");
  detail::require_same_dtype(dy_, x_, op, "dy", "x");
  detail::require_same_device(dy_, x_, op, "dy", "x");
  detail::require_shape(dy_, x_.shape(), op, "dy");
  const Shape lead = detail::leading_shape(x_);
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&mean_, "mean"}, {&rstd_, "rstd"}}) {
    detail::require_real(*t, op, name);
    detail::require_same_dtype(*t, x_, op, name, "x");
    detail::require_same_device(*t, x_, op, name, "x");
    detail::require_shape(*t, lead, op, name);
  }
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               mean = mean_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = detail::new_output(x.shape(), x.dtype(), x.device());
  switch (x.device()) {
    case Device::cpu:
      cpu::layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
      break;
    case Device::cuda:
      detail::no_cuda_yet(op, x, "x");
  }
  return dx;
}

}  // namespace hlm::ops
