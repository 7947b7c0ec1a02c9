#include "layers/module.h"

#include "core/rng.h"

namespace hlm {

std::vector<std::pair<std::string, Param*>> Module::named_parameters(const std::string& prefix) {
  std::vector<std::pair<std::string, Param*>> out;
  for (auto& p : params_) out.emplace_back(prefix + p->name, p.get());
  for (auto& [name, child] : children_) {
    // An empty child name adds no component: the child's parameters sit beside the parent's.
    auto sub = child->named_parameters(name.empty() ? prefix : prefix + name + ".");
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

Param* Module::find_parameter(const std::string& full_name) {
  for (auto& [n, p] : named_parameters())
    if (n == full_name) return p;
  return nullptr;
}

int64_t Module::parameter_count() {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters()) n += p->value.numel();
  return n;
}

void Module::to_dtype(DType dt) {
  HLM_CHECK(is_floating(dt), "to_dtype: {} is not a floating dtype", dtype_name(dt));
  for (auto& [name, p] : named_parameters()) {
    const DType target = p->keep_fp32 ? DType::f32 : dt;
    // keep_fp32 parameters follow an f64 cast (FP64 reference runs) but never go below f32.
    const DType t = (p->keep_fp32 && dt == DType::f64) ? DType::f64 : target;
    if (p->value.dtype() != t) p->value = p->value.to(t);
    p->grad = Tensor();
  }
}

void Module::keep_gemm_weights_in_bf16() {
  for (auto& [name, child] : children_) child->keep_gemm_weights_in_bf16();
}

void Module::to(Device dev) {
  for (auto& [name, p] : named_parameters()) {
    if (p->value.defined() && p->value.device() != dev) p->value = p->value.to(dev);
    if (p->grad.defined() && p->grad.device() != dev) p->grad = p->grad.to(dev);
  }
}

void Module::zero_grad() {
  for (auto& [name, p] : named_parameters()) {
    const DType gd = grad_dtype_for(p->value.dtype());
    if (!p->grad.defined() || p->grad.shape() != p->value.shape() || p->grad.dtype() != gd ||
        p->grad.device() != p->value.device())
      p->grad = Tensor::zeros(p->value.shape(), gd, p->value.device());
    else
      p->grad.zero_();
  }
}

Param& Module::add_param(const std::string& name, Tensor value, bool keep_fp32,
                         bool no_weight_decay) {
  for (auto& p : params_) HLM_CHECK(p->name != name, "parameter '{}' registered twice", name);
  auto p = std::make_unique<Param>();
  p->name = name;
  p->value = std::move(value);
  p->keep_fp32 = keep_fp32;
  p->no_weight_decay = no_weight_decay || keep_fp32;
  params_.push_back(std::move(p));
  return *params_.back();
}

void Module::add_child(const std::string& name, Module* child) {
  children_.emplace_back(name, child);
}

Tensor& ensure_grad(Param& p, std::string_view owner) {
  const DType gd = grad_dtype_for(p.value.dtype());
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), gd, p.value.device());
  HLM_CHECK(p.grad.shape() == p.value.shape() && p.grad.is_contiguous() &&
                (p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::f64) &&
                p.grad.device() == p.value.device(),
            "{}: gradient of '{}' is {}, expected a contiguous {} {} on the device of the "
            "parameter ({})",
            owner, p.name, p.grad.describe(), dtype_name(gd), shape_str(p.value.shape()),
            device_name(p.value.device()));
  return p.grad;
}

uint64_t name_stream(std::string_view full_name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : full_name) h = (h ^ c) * 1099511628211ull;
  return h;
}

void init_normal_named(Tensor& value, uint64_t seed, std::string_view full_name, double std,
                       uint64_t first) {
  Rng rng(seed, name_stream(full_name));
  rng.set_counter(first);
  rng.fill_normal(value, 0.0, std);
}

}  // namespace hlm
