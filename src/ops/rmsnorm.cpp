// The front door of RMSNorm and gated RMSNorm (ops/rmsnorm.h): argument checks, output
// allocation, and the switch to the CPU reference (ops/cpu/rmsnorm.cpp) or the CUDA kernels
// (ops/cuda/norms.cu).
#include "ops/rmsnorm.h"

#include "ops/cpu/rmsnorm.h"
#include "ops/cuda/norms.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

void check_common(const char* op, const Tensor& x, const Tensor& w) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., D], got {}", op, x.describe());
  detail::require_float_dev(w, op, "w");
  detail::require_same_device(w, x, op, "w", "x");
  detail::require_param_dtype(w, x, op, "w");
  detail::require_shape(w, {x.size(-1)}, op, "w");
}

void check_backward(const char* op, const Tensor& dy, const Tensor& x, const Tensor& w,
                    const Tensor& rstd, const Tensor& dw) {
  check_common(op, x, w);
  detail::require_like_x(dy, x, x.shape(), op, "dy");
  detail::require_rstd(rstd, x, op);
  detail::require_param_grad(dw, x, w.shape(), op, "dw");
}

void check_gate(const char* op, const Tensor& gate, const Tensor& x) {
  detail::require_like_x(gate, x, x.shape(), op, "gate");
}

RmsNormResult forward(const char* op, const Tensor& x_, const Tensor* gate_, const Tensor& w_,
                      double eps) {
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  const Tensor gate = gate_ ? gate_->contiguous() : Tensor();
  const Tensor* g = gate_ ? &gate : nullptr;
  const Device dev = x.device();
  RmsNormResult out{
      detail::new_output(x.shape(), x.dtype(), dev),
      detail::new_output(detail::leading_shape(x), detail::compute_dtype(x.dtype()), dev)};
  HLM_DISPATCH(op, dev, rmsnorm_forward, x, g, w, eps, out.y, out.rstd);
  return out;
}

GatedRmsNormGrads backward(const char* op, const Tensor& dy_, const Tensor& x_, const Tensor* gate_,
                           const Tensor& w_, const Tensor& rstd_, Tensor& dw) {
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               rstd = rstd_.contiguous();
  const Tensor gate = gate_ ? gate_->contiguous() : Tensor();
  const Tensor* g = gate_ ? &gate : nullptr;
  const Device dev = x.device();
  GatedRmsNormGrads out;
  out.dx = detail::new_output(x.shape(), x.dtype(), dev);
  if (g) out.dgate = detail::new_output(x.shape(), x.dtype(), dev);
  Tensor* dgate = g ? &out.dgate : nullptr;
  HLM_DISPATCH(op, dev, rmsnorm_backward, dy, x, g, w, rstd, out.dx, dgate, dw);
  return out;
}

}  // namespace

RmsNormResult rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  constexpr const char* op = "rmsnorm_forward";
  check_common(op, x, w);
  return forward(op, x, nullptr, w, eps);
}

Tensor rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dw) {
  constexpr const char* op = "rmsnorm_backward";
  check_backward(op, dy, x, w, rstd, dw);
  return backward(op, dy, x, nullptr, w, rstd, dw).dx;
}

RmsNormResult gated_rmsnorm_forward(const Tensor& x, const Tensor& gate, const Tensor& w,
                                    double eps) {
  constexpr const char* op = "gated_rmsnorm_forward";
  check_common(op, x, w);
  check_gate(op, gate, x);
  return forward(op, x, &gate, w, eps);
}

GatedRmsNormGrads gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gate,
                                         const Tensor& w, const Tensor& rstd, Tensor& dw) {
  constexpr const char* op = "gated_rmsnorm_backward";
  check_backward(op, dy, x, w, rstd, dw);
  check_gate(op, gate, x);
  return backward(op, dy, x, &gate, w, rstd, dw);
}

}  // namespace hlm::ops
