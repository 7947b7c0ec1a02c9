// AdamW with FP32 master weights (see adamw.h for the formulas and the determinism contract).
#include "train/adamw.h"

#include <cmath>
#include <cstring>
#include <set>

#include "ops/dispatch.h"
#include "ops/tensor_ops.h"
#include "train/cuda/adamw.cuh"

namespace hlm::train {
namespace {

bool supported_value_dtype(DType dt) {
  return dt == DType::f64 || dt == DType::f32 || dt == DType::bf16 || dt == DType::f16;
}

void check_grad(const Param& p, const std::string& name) {
  HLM_CHECK(p.grad.defined(), "AdamW: parameter '{}' has no gradient (zero_grad before backward)",
            name);
  HLM_CHECK(p.grad.device() == p.value.device(),
            "AdamW: gradient of '{}' must be on the parameter's device ({}), got {}", name,
            device_name(p.value.device()), p.grad.describe());
  HLM_CHECK(p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::f64,
            "AdamW: gradient of '{}' must be f32 or f64, got {}", name, p.grad.describe());
  HLM_CHECK(p.grad.shape() == p.value.shape(),
            "AdamW: gradient of '{}' has shape {}, the parameter has {}", name,
            shape_str(p.grad.shape()), shape_str(p.value.shape()));
  HLM_CHECK(p.grad.is_contiguous(), "AdamW: gradient of '{}' must be contiguous", name);
}

template <class G>
double sum_squares(const G* g, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double x = double(g[i]);
    s += x * x;
  }
  return s;
}

// Per element, in FP64 from the stored values; m and v are rounded to M before they are used.
template <class M, class G>
void adamw_update(M* w, M* m, M* v, const G* g, int64_t n, double scale, double b1, double b2,
                  double decay_mul, double lr, double bc1, double bc2, double eps) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    const double gi = double(g[i]) * scale;
    const M mi = M(b1 * double(m[i]) + (1.0 - b1) * gi);
    const M vi = M(b2 * double(v[i]) + (1.0 - b2) * gi * gi);
    m[i] = mi;
    v[i] = vi;
    double wi = double(w[i]) * decay_mul;
    wi -= lr * (double(mi) / bc1) / (std::sqrt(double(vi) / bc2) + eps);
    w[i] = M(wi);
  }
}

template <class M>
void update_dispatch_grad(M* w, M* m, M* v, const Tensor& grad, int64_t n, double scale, double b1,
                          double b2, double decay_mul, double lr, double bc1, double bc2,
                          double eps) {
  if (grad.dtype() == DType::f64)
    adamw_update(w, m, v, grad.data<double>(), n, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
  else
    adamw_update(w, m, v, grad.data<float>(), n, scale, b1, b2, decay_mul, lr, bc1, bc2, eps);
}

// The first element of a loaded state tensor (f32 or f64) that is not finite, or (when
// `nonnegative`) negative; -1 when there is none. No copy of the tensor is made.
template <class T>
int64_t first_bad(const T* p, int64_t n, bool nonnegative) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i]) || (nonnegative && p[i] < 0)) return i;
  return -1;
}
int64_t first_bad(const Tensor& t, bool nonnegative) {
  const Tensor c = t.contiguous();
  return c.dtype() == DType::f64 ? first_bad(c.data<double>(), c.numel(), nonnegative)
                                 : first_bad(c.data<float>(), c.numel(), nonnegative);
}

}  // namespace

DecayDecision weight_decay_decision(const Param& p, const AdamWConfig& cfg) {
  if (cfg.weight_decay == 0) return {false, "weight_decay is 0"};
  if (p.keep_fp32) return {false, "keep_fp32"};
  if (p.no_weight_decay) return {false, "no_weight_decay"};
  if (p.value.dim() < 2 && !cfg.decay_1d) return {false, "fewer than 2 dimensions"};
  return {true, "decayed"};
}

AdamW::AdamW(std::vector<std::pair<std::string, Param*>> params, AdamWConfig cfg) : cfg_(cfg) {
  HLM_CHECK(std::isfinite(cfg.beta1) && cfg.beta1 >= 0 && cfg.beta1 < 1,
            "AdamW: beta1 must be in [0, 1), got {}", cfg.beta1);
  HLM_CHECK(std::isfinite(cfg.beta2) && cfg.beta2 >= 0 && cfg.beta2 < 1,
            "AdamW: beta2 must be in [0, 1), got {}", cfg.beta2);
  HLM_CHECK(std::isfinite(cfg.eps) && cfg.eps > 0, "AdamW: eps must be finite and > 0, got {}",
            cfg.eps);
  HLM_CHECK(std::isfinite(cfg.weight_decay) && cfg.weight_decay >= 0,
            "AdamW: weight_decay must be finite and >= 0, got {}", cfg.weight_decay);
  HLM_CHECK(!std::isnan(cfg.max_grad_norm), "AdamW: max_grad_norm is NaN");
  std::set<std::string> seen;
  for (auto& [name, p] : params) {
    HLM_CHECK(p != nullptr, "AdamW: parameter '{}' is null", name);
    HLM_CHECK(seen.insert(name).second, "AdamW: parameter name '{}' appears twice", name);
    const Tensor& val = p->value;
    HLM_CHECK(val.defined(), "AdamW: parameter '{}' has no value", name);
    HLM_CHECK(val.is_contiguous(), "AdamW: parameter '{}' must be contiguous", name);
    HLM_CHECK(val.is_cpu() || val.dtype() != DType::f16,
              "AdamW: f16 parameter '{}' on CUDA is not supported (bf16, f32 or f64 are)", name);
    HLM_CHECK(supported_value_dtype(val.dtype()),
              "AdamW: parameter '{}' must be f64, f32, bf16 or f16, got {}", name, val.describe());
    HLM_CHECK(!p->keep_fp32 || val.dtype() == DType::f32 || val.dtype() == DType::f64,
              "AdamW: keep_fp32 parameter '{}' must be f32 or f64, got {}", name, val.describe());
    Slot s;
    s.name = name;
    s.param = p;
    const DType md = hlm::compute_dtype(val.dtype());
    s.separate_master = val.dtype() != md;
    s.master = s.separate_master ? ops::as_dtype(val, md) : val;
    s.m = Tensor::zeros(val.shape(), md, val.device());
    s.v = Tensor::zeros(val.shape(), md, val.device());
    s.decision = weight_decay_decision(*p, cfg);
    slots_.push_back(std::move(s));
  }
}

const AdamW::Slot& AdamW::slot(const std::string& name) const {
  for (const Slot& s : slots_)
    if (s.name == name) return s;
  HLM_FAIL("AdamW: no parameter named '{}'", name);
}

const DecayDecision& AdamW::decision(const std::string& name) const {
  return slot(name).decision;
}
const Tensor& AdamW::master(const std::string& name) const {
  return slot(name).master;
}
const Tensor& AdamW::exp_avg(const std::string& name) const {
  return slot(name).m;
}
const Tensor& AdamW::exp_avg_sq(const std::string& name) const {
  return slot(name).v;
}

double AdamW::grad_sum_squares() const {
  double total = 0;
  for (double ps : grad_sum_squares_per_param()) total += ps;
  return total;
}

std::vector<double> AdamW::grad_sum_squares_per_param() const {
  struct Task {
    size_t slot;
    int64_t begin, end;
  };
  // CPU parameters: one task per block; CUDA parameters: all their blocks in one kernel.
  std::vector<Task> tasks;
  std::vector<std::vector<double>> device_partial(slots_.size());
  std::vector<const Tensor*> device_grads;
  std::vector<size_t> device_slots;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Param& p = *slots_[i].param;
    check_grad(p, slots_[i].name);
    const int64_t n = p.grad.numel();
    if (!p.grad.is_cpu()) {
      device_grads.push_back(&p.grad);
      device_slots.push_back(i);
      continue;
    }
    for (int64_t b = 0; b < n; b += kNormBlock)
      tasks.push_back({i, b, std::min(n, b + kNormBlock)});
  }
  if (!device_grads.empty()) {
    // Every CUDA parameter's blocks in one launch, handed back per parameter.
    std::vector<double> all;
    HLM_CUDA_PATH("AdamW", all = cuda::block_sum_squares(device_grads, kNormBlock));
    size_t k = 0;
    for (size_t j = 0; j < device_grads.size(); ++j) {
      const size_t nb = size_t((device_grads[j]->numel() + kNormBlock - 1) / kNormBlock);
      device_partial[device_slots[j]].assign(all.begin() + ptrdiff_t(k),
                                             all.begin() + ptrdiff_t(k + nb));
      k += nb;
    }
  }
  std::vector<double> partial(tasks.size(), 0.0);
#pragma omp parallel for schedule(dynamic, 1) if (tasks.size() > 1)
  for (size_t k = 0; k < tasks.size(); ++k) {
    const Tensor& g = slots_[tasks[k].slot].param->grad;
    partial[k] = g.dtype() == DType::f64
                     ? sum_squares(g.data<double>(), tasks[k].begin, tasks[k].end)
                     : sum_squares(g.data<float>(), tasks[k].begin, tasks[k].end);
  }
  // Blocks of a parameter in order.
  std::vector<double> out(slots_.size(), 0.0);
  size_t k = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    double ps = 0;
    for (; k < tasks.size() && tasks[k].slot == i; ++k) ps += partial[k];
    for (double d : device_partial[i]) ps += d;
    out[i] = ps;
  }
  return out;
}

std::string AdamW::state_param(const std::string& key, const std::string& prefix) {
  const std::string rest = key.substr(prefix.size());
  for (const char* k : kStateKinds)
    if (rest.rfind(k, 0) == 0) return rest.substr(std::strlen(k));
  return "";
}

GradNorm AdamW::grad_norm() const {
  return grad_norm_from(grad_sum_squares());
}

GradNorm AdamW::grad_norm_from(double sum_squares) const {
  GradNorm r;
  r.norm = std::sqrt(sum_squares);
  r.finite = std::isfinite(r.norm);
  if (r.finite && cfg_.max_grad_norm > 0 && r.norm > cfg_.max_grad_norm)
    r.clip_scale = cfg_.max_grad_norm / r.norm;
  return r;
}

StepResult AdamW::step(double lr) {
  return step(lr, grad_norm());
}

StepResult AdamW::step(double lr, const GradNorm& gn) {
  HLM_CHECK(std::isfinite(lr) && lr >= 0, "AdamW::step: lr must be finite and >= 0, got {}", lr);
  HLM_CHECK(!gn.finite || (std::isfinite(gn.clip_scale) && gn.clip_scale > 0),
            "AdamW::step: the clip scale must be finite and > 0, got {}", gn.clip_scale);
  StepResult r;
  r.grad_norm = gn.norm;
  r.clip_scale = gn.clip_scale;
  r.finite = gn.finite;
  r.step = step_;
  if (!gn.finite) return r;

  const int64_t t = step_ + 1;
  const double b1 = cfg_.beta1, b2 = cfg_.beta2;
  const double bc1 = 1.0 - std::pow(b1, double(t)), bc2 = 1.0 - std::pow(b2, double(t));
  // CUDA parameters: every one in a single launch, then their bf16 / f16 values.
  std::vector<cuda::UpdateSlot> device_slots;
  for (Slot& s : slots_) {
    if (s.master.is_cpu()) continue;
    const Tensor& g = s.param->grad;
    device_slots.push_back({s.master.raw(), s.m.raw(), s.v.raw(), g.raw(), s.master.numel(),
                            s.decision.decay ? 1.0 - lr * cfg_.weight_decay : 1.0,
                            s.master.dtype() == DType::f64 ? 1 : 0,
                            g.dtype() == DType::f64 ? 1 : 0});
  }
  if (!device_slots.empty()) {
    const cuda::UpdateStep st{gn.clip_scale, b1, b2, lr, bc1, bc2, cfg_.eps};
    (void)st;  // (unused in a build without CUDA)
    HLM_CUDA_PATH("AdamW", cuda::adamw_update(device_slots, st));
    for (Slot& s : slots_)
      if (!s.master.is_cpu() && s.separate_master) write_back(s);
  }
  for (Slot& s : slots_) {
    const double decay_mul = s.decision.decay ? 1.0 - lr * cfg_.weight_decay : 1.0;
    const Tensor& g = s.param->grad;
    const int64_t n = s.master.numel();
    if (!s.master.is_cpu()) continue;
    if (s.master.dtype() == DType::f64)
      update_dispatch_grad(s.master.data<double>(), s.m.data<double>(), s.v.data<double>(), g, n,
                           gn.clip_scale, b1, b2, decay_mul, lr, bc1, bc2, cfg_.eps);
    else
      update_dispatch_grad(s.master.data<float>(), s.m.data<float>(), s.v.data<float>(), g, n,
                           gn.clip_scale, b1, b2, decay_mul, lr, bc1, bc2, cfg_.eps);
    if (s.separate_master) write_back(s);
  }
  step_ = t;
  r.applied = true;
  r.step = step_;
  return r;
}

void AdamW::write_back(Slot& s) {
  if (!s.separate_master) return;
  if (!s.master.is_cpu()) {
    ops::copy_into(s.param->value, s.master);  // one round to nearest even, as below
    return;
  }
  const float* w = s.master.data<float>();
  const int64_t n = s.master.numel();
  Tensor& val = s.param->value;
  if (val.dtype() == DType::bf16) {
    bf16* out = val.data<bf16>();
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(w[i]);
  } else {
    f16* out = val.data<f16>();
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_f16(w[i]);
  }
}

void AdamW::sync_master_from_params() {
  for (Slot& s : slots_) {
    const Tensor& val = s.param->value;
    HLM_CHECK(val.defined() && val.shape() == s.master.shape() &&
                  val.device() == s.master.device() && val.is_contiguous() &&
                  supported_value_dtype(val.dtype()),
              "AdamW: parameter '{}' changed to {} (expected shape {})", s.name, val.describe(),
              shape_str(s.master.shape()));
    const DType md = hlm::compute_dtype(val.dtype());
    HLM_CHECK(md == s.master.dtype(), "AdamW: parameter '{}' changed dtype to {}", s.name,
              dtype_name(val.dtype()));
    s.separate_master = val.dtype() != md;
    if (s.separate_master)
      ops::copy_into(s.master, val);
    else
      s.master = val;
  }
}

safetensors::TensorMap AdamW::state_dict(const std::string& prefix) const {
  safetensors::TensorMap m;
  m[prefix + "step"] = Tensor::from_vector<int64_t>({}, {step_});
  // CUDA state is copied to the host (a checkpoint writes host tensors).
  auto host = [](const Tensor& t) { return t.is_cpu() ? t : t.to(Device::cpu); };
  for (const Slot& s : slots_) {
    m[prefix + "master." + s.name] = host(s.master);
    m[prefix + "exp_avg." + s.name] = host(s.m);
    m[prefix + "exp_avg_sq." + s.name] = host(s.v);
  }
  return m;
}

void AdamW::load_state_dict(const safetensors::TensorMap& state, const std::string& prefix) {
  // Validate everything first, so a rejected state leaves the optimizer untouched.
  std::set<std::string> expected{prefix + "step"};
  for (const Slot& s : slots_)
    for (const char* kind : kStateKinds) expected.insert(prefix + kind + s.name);
  for (auto& [key, t] : state) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    HLM_CHECK(expected.count(key),
              "optimizer state: '{}' does not belong to any parameter of this model (the state "
              "was saved for a different parameter set)",
              key);
  }
  auto find = [&](const std::string& key) -> const Tensor& {
    auto it = state.find(key);
    HLM_CHECK(it != state.end(), "optimizer state: '{}' is missing", key);
    HLM_CHECK(it->second.defined() && it->second.is_cpu(),
              "optimizer state: '{}' must be a CPU tensor", key);
    return it->second;
  };
  const Tensor& st = find(prefix + "step");
  HLM_CHECK(st.dtype() == DType::i64 && st.numel() == 1,
            "optimizer state: '{}step' must be one i64, got {}", prefix, st.describe());
  const int64_t step = int64_t(st.item());
  HLM_CHECK(step >= 0, "optimizer state: '{}step' is negative ({})", prefix, step);
  for (const Slot& s : slots_) {
    for (const char* kind : kStateKinds) {
      const std::string key = prefix + kind + s.name;
      const Tensor& t = find(key);
      HLM_CHECK(t.shape() == s.master.shape(),
                "optimizer state: '{}' has shape {}, parameter '{}' has {}", key,
                shape_str(t.shape()), s.name, shape_str(s.master.shape()));
      HLM_CHECK(t.dtype() == s.master.dtype(),
                "optimizer state: '{}' is {}, parameter '{}' needs {}", key, dtype_name(t.dtype()),
                s.name, dtype_name(s.master.dtype()));
      const bool v = kind == kStateKinds[2];  // the second moments: >= 0
      const int64_t bad = first_bad(t, v);
      HLM_CHECK(bad < 0, "optimizer state: '{}' holds {} at flat index {}", key,
                v ? "a negative or non-finite value" : "a non-finite value", bad);
    }
  }
  for (Slot& s : slots_) {
    s.master.copy_(state.at(prefix + "master." + s.name));
    s.m.copy_(state.at(prefix + "exp_avg." + s.name));
    s.v.copy_(state.at(prefix + "exp_avg_sq." + s.name));
    write_back(s);
  }
  step_ = step;
}

}  // namespace hlm::train
