// RmsNorm module (layers/norm.h) over ops::rmsnorm_forward / rmsnorm_backward.
//
// Forward:  rstd = 1 / sqrt(mean(x^2) + eps);  y = x * rstd * w
// Backward: dx   = rstd * w * dy - rstd^3 / D * x * sum_j(dy_j w_j x_j)   (written, =)
//           dw  += sum over rows of dy * x * rstd                          (accumulated)
#include "layers/norm.h"

#include <cmath>

#include "ops/rmsnorm.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

// Contiguous in dtype dt on t's device (Tensor's own copies on the CPU, ops/tensor_ops.h on CUDA).
Tensor as_dtype(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
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
  HLM_CHECK(x.defined() && x.device() == weight_->value.device(),
            "RmsNorm({}): x must be a defined tensor on the weight's device ({}), got {}", path_,
            device_name(weight_->value.device()), x.defined() ? x.describe() : "undefined");
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
  return ops::as_dtype(r.y, x.dtype());
}

Tensor RmsNorm::backward(const Context& ctx, const Tensor& dy, const Saved& saved) {
  HLM_CHECK(saved.x.defined(),
            "RmsNorm({})::backward: Saved is empty (run forward with ctx.training)", path_);
  HLM_CHECK(dy.defined() && is_floating(dy.dtype()) && dy.shape() == saved.x.shape() &&
                dy.device() == saved.x.device(),
            "RmsNorm({})::backward: dy must be floating {} on x's device ({}), got {}", path_,
            shape_str(saved.x.shape()), device_name(saved.x.device()),
            dy.defined() ? dy.describe() : "undefined");
  const DType cdt = saved.x.dtype();
  const Tensor w = as_dtype(weight_->value, cdt);
  Tensor rstd = saved.rstd;
  if (!rstd.defined()) rstd = ops::rmsnorm_forward(saved.x, w, cfg_.eps).rstd;  // recompute
  Param& p = *weight_;
  if (!p.grad.defined())
    p.grad = Tensor::zeros(p.value.shape(), grad_dtype_for(p.value.dtype()), p.value.device());
  HLM_CHECK(p.grad.shape() == p.value.shape() &&
                (p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::f64) &&
                p.grad.device() == p.value.device(),
            "RmsNorm({}): weight.grad is {}, expected f32/f64 {} on the weight's device", path_,
            p.grad.describe(), shape_str(p.value.shape()));
  Tensor dx;
  if (p.grad.dtype() == cdt && p.grad.is_contiguous()) {
    dx = ops::rmsnorm_backward(as_dtype(dy, cdt), saved.x, w, rstd, p.grad);
  } else {
    // Accumulate in the compute dtype, then add once into the gradient's dtype.
    Tensor dw = Tensor::zeros(p.value.shape(), cdt, p.value.device());
    dx = ops::rmsnorm_backward(as_dtype(dy, cdt), saved.x, w, rstd, dw);
    if (!p.grad.is_cpu()) {
      // The same on CUDA: the sum in f64 (both addends exact there), rounded once.
      if (p.grad.dtype() == DType::f64) {
        ops::add_(p.grad, dw);
      } else {
        Tensor sum = ops::as_dtype(p.grad, DType::f64);
        ops::add_(sum, dw);
        ops::copy_into(p.grad, sum);
      }
      (void)ctx;
      return ops::as_dtype(dx, saved.x_dtype);
    }
    Tensor sum = p.grad.to(DType::f64);
    const std::vector<double> v = dw.to_f64_vector();
    double* s = sum.data<double>();
    for (size_t i = 0; i < v.size(); ++i) s[i] += v[i];
    p.grad.copy_(sum);
  }
  (void)ctx;
  return ops::as_dtype(dx, saved.x_dtype);
}

}  // namespace hlm
