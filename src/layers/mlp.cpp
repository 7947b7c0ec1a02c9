// DenseMlp (layers/mlp.h): clamped SwiGLU over three Linear GEMMs.
//
// Forward:  gu = [x Wg^T | x Wu^T];  h = swiglu_clamped(gu, L);  y = h Wd^T
// Backward: dh = dy Wd (down_proj.backward, dWd += dy^T h)
//           dgu = swiglu_clamped_backward(gu, dh, L)            (zero where the clamp is active)
//           dx = gate_proj.backward(dg) + up_proj.backward(du)  (added in that order; dW +=)
#include "layers/mlp.h"

#include <cmath>
#include <vector>

#include "ops/moe.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

// Copies, conversions and sums on the input's device (ops/tensor_ops.h: Tensor's own on the CPU).
Tensor as_dtype(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
}

// a + b elementwise (same shape, contiguous, f32 or f64), in that order: one addition per element.
Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  ops::copy_into(out, a);
  ops::add_(out, b);
  return out;
}

}  // namespace

void DenseMlpConfig::validate() const {
  HLM_CHECK(hidden_size >= 1, "DenseMlpConfig.hidden_size must be >= 1, got {}", hidden_size);
  HLM_CHECK(intermediate_size >= 1, "DenseMlpConfig.intermediate_size must be >= 1, got {}",
            intermediate_size);
  HLM_CHECK(!std::isnan(swiglu_limit), "DenseMlpConfig.swiglu_limit must not be NaN");
  HLM_CHECK(dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16,
            "DenseMlpConfig.dtype must be f64, f32 or bf16, got {}", dtype_name(dtype));
  HLM_CHECK(std::isfinite(init_std) && init_std >= 0,
            "DenseMlpConfig.init_std must be finite and >= 0, got {}", init_std);
}

DenseMlp::DenseMlp(const DenseMlpConfig& cfg, const PrecisionPolicy& policy,
                   const std::string& path, ModuleRole role)
    : cfg_(cfg), path_(path), role_(role) {
  cfg_.validate();
  const int64_t D = cfg_.hidden_size, I = cfg_.intermediate_size;
  const std::string pre = path_.empty() ? "" : path_ + ".";
  gate_.init(D, I, false, policy.resolve(pre + "gate_proj", role), cfg_.dtype);
  up_.init(D, I, false, policy.resolve(pre + "up_proj", role), cfg_.dtype);
  down_.init(I, D, false, policy.resolve(pre + "down_proj", role), cfg_.dtype);
  add_child("gate_proj", &gate_);
  add_child("up_proj", &up_);
  add_child("down_proj", &down_);
  for (auto& [name, p] : named_parameters())
    init_normal_named(p->value, cfg_.seed, pre + name, cfg_.init_std);
}

void DenseMlp::run_forward(const Context& ctx, const Tensor& xc, Saved& s, Tensor* y) const {
  const int64_t T = xc.size(0), I = cfg_.intermediate_size;
  const bool keep = ctx.training;
  Tensor gu = Tensor::empty({T, 2 * I}, xc.dtype(), xc.device());
  Tensor gate_half = gu.slice(1, 0, I), up_half = gu.slice(1, I, 2 * I);
  if (!keep && gate_.writes_directly(DType::bf16, xc.dtype()) &&
      up_.writes_directly(DType::bf16, xc.dtype())) {
    // Inference under bf16 GEMMs: x rounded once, one grouped GEMM writing both halves of gu.
    const Tensor xg = as_dtype(xc, DType::bf16);
    std::vector<Tensor> halves = {gate_half, up_half};
    Linear::forward_into_many(xg, {&gate_, &up_}, halves);
  } else {
    ops::copy_into(gate_half, gate_.forward(ctx, xc, keep ? &s.gate : nullptr));
    ops::copy_into(up_half, up_.forward(ctx, xc, keep ? &s.up : nullptr));
  }
  Tensor out;
  if (!keep && down_.writes_directly(DType::bf16, xc.dtype())) {
    // Inference under a bf16 down GEMM: h written in bf16 (what the GEMM rounds it to).
    out = Tensor::empty({T, cfg_.hidden_size}, xc.dtype(), xc.device());
    down_.forward_into(ops::swiglu_clamped_forward(gu, cfg_.swiglu_limit, DType::bf16), out);
  } else {
    const Tensor h = ops::swiglu_clamped_forward(gu, cfg_.swiglu_limit);
    out = down_.forward(ctx, h, keep ? &s.down : nullptr);
  }
  if (keep) s.gu = gu;
  if (y) *y = out;
}

Tensor DenseMlp::forward(const Context& ctx, const Tensor& x, Saved* saved) const {
  HLM_CHECK(x.defined() && x.device() == gate_.weight_value().device(),
            "DenseMlp({}): x must be a defined tensor on the parameters' device ({}), got {}",
            path_, device_name(gate_.weight_value().device()),
            x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "DenseMlp({}): x must be f64, f32 or bf16, got {}", path_, x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == cfg_.hidden_size,
            "DenseMlp({}): x must be [T, {}], got {}", path_, cfg_.hidden_size, x.describe());
  const Tensor xc = as_dtype(x, hlm::compute_dtype(x.dtype()));
  const bool keep = saved && ctx.training;
  Saved local;
  Saved& s = keep ? *saved : local;
  s = Saved{};
  Tensor y;
  run_forward(keep ? ctx : Context{false, false}, xc, s, &y);
  if (keep) {
    s.x = xc;
    s.x_dtype = x.dtype();
    if (ctx.recompute) {
      // Keep only the input: g, u and h are recomputed by backward.
      s.gate = s.up = s.down = Linear::Saved{};
      s.gu = Tensor();
      s.recomputed = true;
    }
  }
  return ops::as_dtype(y, x.dtype());
}

Tensor DenseMlp::backward(const Context& ctx, const Tensor& dy, const Saved& saved) {
  HLM_CHECK(saved.x.defined(),
            "DenseMlp({})::backward: Saved is empty (run forward with ctx.training)", path_);
  const int64_t T = saved.x.size(0), I = cfg_.intermediate_size;
  HLM_CHECK(dy.defined() && is_floating(dy.dtype()) && dy.shape() == Shape({T, cfg_.hidden_size}) &&
                dy.device() == saved.x.device(),
            "DenseMlp({})::backward: dy must be floating [{}, {}] on x's device ({}), got {}",
            path_, T, cfg_.hidden_size, device_name(saved.x.device()),
            dy.defined() ? dy.describe() : "undefined");
  const Saved* s = &saved;
  Saved re;
  if (saved.recomputed) {
    re.x = saved.x;
    re.x_dtype = saved.x_dtype;
    run_forward(Context{true, false}, saved.x, re, nullptr);
    s = &re;
  }
  const DType cdt = saved.x.dtype();
  const Tensor dh = down_.backward(ctx, as_dtype(dy, cdt), s->down);
  const Tensor dgu = ops::swiglu_clamped_backward(s->gu, dh, cfg_.swiglu_limit);
  const Tensor dx_g = gate_.backward(ctx, ops::contiguous(dgu.slice(1, 0, I)), s->gate);
  const Tensor dx_u = up_.backward(ctx, ops::contiguous(dgu.slice(1, I, 2 * I)), s->up);
  const Tensor dx = add(as_dtype(dx_g, cdt), as_dtype(dx_u, cdt));
  return ops::as_dtype(dx, saved.x_dtype);
}

}  // namespace hlm
