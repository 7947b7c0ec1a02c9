// RmsNorm module (layers/norm.h) over ops::rmsnorm_forward / rmsnorm_backward.
//
// Forward:  rstd = 1 / sqrt(mean(x^2) + eps);  y = x * rstd * w
// Backward: dx   = rstd * w * dy - rstd^3 / D * x * sum_j(dy_j w_j x_j)   (written, =)
//           dw  += sum over rows of dy * x * rstd                          (accumulated)
#include "layers/norm.h"

#include <cmath>

#include "ops/rmsnorm.h"

namespace hlm {

namespace {

Tensor as_dtype(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t.contiguous() : t.to(dt);
}

}  // namespace

void RmsNormConfig::validate() const {
  HLM_CHECK(dim >= 1, "RmsNormConfig.dim must be >= 1, got {}", dim);
  HLM_CHECK(std::isfinite(eps) && eps >= 0, "RmsNormConfig.eps must be finite and >= 0, got {}",
            eps);
  HLM_CHECK(dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16,
            "RmsNormConfig.dtype must be f64, f32 or bf16, got {}", dtype_name(dtype));
}

RmsNorm::RmsNorm(const RmsNormConfig& cfg, const std::string& path) : cfg_(cfg), path_(path) {
  cfg_.validate();
  weight_ = &add_param("weight", Tensor::full({cfg_.dim}, 1.0, cfg_.dtype), false, true);
}

Tensor RmsNorm::forward(const Context& ctx, const Tensor& x, Saved* saved) const {
  HLM_CHECK(x.defined() && x.is_cpu(), "RmsNorm({}): x must be a defined CPU tensor", path_);
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "RmsNorm({}): x must be f64, f32 or bf16, got {}", path_, x.describe());
  HLM_CHECK(x.dim() >= 1 && x.size(-1) == cfg_.dim, "RmsNorm({}): x must be [..., {}], got {}",
            path_, cfg_.dim, x.describe());
  const DType cdt = hlm::compute_dtype(x.dtype());
  const Tensor xc = as_dtype(x, cdt);
  ops::RmsNormResult r = ops::rmsnorm_forward(xc, as_dtype(weight_->value, cdt), cfg_.eps);
  if (saved && ctx.training) {
    saved->x = xc;
    saved->rstd = ctx.recompute ? Tensor() : r.rstd;
    saved->x_dtype = x.dtype();
  }
  return x.dtype() == cdt ? r.y : r.y.to(x.dtype());
}

Tensor RmsNorm::backward(const Context& ctx, const Tensor& dy, const Saved& saved) {
  HLM_CHECK(saved.x.defined(),
            "RmsNorm({})::backward: Saved is empty (run forward with ctx.training)", path_);
  HLM_CHECK(dy.defined() && is_floating(dy.dtype()) && dy.shape() == saved.x.shape(),
            "RmsNorm({})::backward: dy must be floating {}, got {}", path_,
            shape_str(saved.x.shape()), dy.defined() ? dy.describe() : "undefined");
  const DType cdt = saved.x.dtype();
  const Tensor w = as_dtype(weight_->value, cdt);
  Tensor rstd = saved.rstd;
  if (!rstd.defined()) rstd = ops::rmsnorm_forward(saved.x, w, cfg_.eps).rstd;  // recompute
  Param& p = *weight_;
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), grad_dtype_for(p.value.dtype()));
  HLM_CHECK(p.grad.shape() == p.value.shape() &&
                (p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::f64),
            "RmsNorm({}): weight.grad is {}, expected f32/f64 {}", path_, p.grad.describe(),
            shape_str(p.value.shape()));
  Tensor dx;
  if (p.grad.dtype() == cdt && p.grad.is_contiguous()) {
    dx = ops::rmsnorm_backward(as_dtype(dy, cdt), saved.x, w, rstd, p.grad);
  } else {
    // Accumulate in the compute dtype, then add once into the gradient's dtype.
    Tensor dw = Tensor::zeros(p.value.shape(), cdt);
    dx = ops::rmsnorm_backward(as_dtype(dy, cdt), saved.x, w, rstd, dw);
    Tensor sum = p.grad.to(DType::f64);
    const std::vector<double> v = dw.to_f64_vector();
    double* s = sum.data<double>();
    for (size_t i = 0; i < v.size(); ++i) s[i] += v[i];
    p.grad.copy_(sum);
  }
  (void)ctx;
  return saved.x_dtype == cdt ? dx : dx.to(saved.x_dtype);
}

}  // namespace hlm
