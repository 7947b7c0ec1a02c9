// RmsNorm: the weighted RMSNorm module (HF Glm5NextTextRMSNorm / DeepseekV3RMSNorm), over the last
// dimension of x [..., D] (e.g. input_layernorm / post_attention_layernorm on [T, D], model.norm,
// MTP enorm / hnorm / shared_head.norm):
//
//   rstd = 1 / sqrt(mean(x^2) + eps)          eps INSIDE the sqrt (rms_norm_eps = 1e-5)
//   y    = x * rstd * w
//
// Conventions (docs/architecture.md): explicit forward and backward, no autograd. forward() fills
// Saved (x in the compute dtype and rstd; under ctx.recompute only x, and the backward recomputes
// rstd, bit for bit). backward() writes dx (=) and accumulates dw into weight().grad (+=). On CPU
// or CUDA tensors: the weight's device (Module::to); x and dy must be there too.
//
// Parameter (HF name, relative to the module path, e.g. "model.layers.3.input_layernorm"):
//   weight [D]   initialised to 1; no weight decay
//
// Precision: compute dtype f64 when x is f64, else f32 (f32 or bf16 x; bf16 or f32 weight read as
// f32). The whole of x * rstd * w is formed in the compute dtype and rounded ONCE to x's dtype
// (HF rounds x * rstd to the activation dtype before multiplying by a bf16 weight: at most one bf16
// rounding apart). Per row (token); a packed batch gives its sequences' results bit for bit.
#pragma once

#include <cstdint>
#include <string>

#include "layers/module.h"

namespace hlm {

struct RmsNormConfig {
  int64_t dim = 0;           // D
  double eps = 1e-5;         // rms_norm_eps
  DType dtype = DType::f32;  // parameter dtype: f64, f32 or bf16

  // Throws hlm::Error naming the field: dim < 1, eps < 0 or not finite, dtype not f64/f32/bf16.
  void validate() const;
};

class RmsNorm : public Module {
 public:
  struct Saved {
    Tensor x;     // the input in the compute dtype
    Tensor rstd;  // [...] (x's shape without D); empty under ctx.recompute
    DType x_dtype = DType::f32;
  };

  // Validates cfg; weight = 1. `path` is the module's full name (kept for messages).
  RmsNorm(const RmsNormConfig& cfg, const std::string& path);

  // x [..., D] f64/f32/bf16 -> y in x's dtype. Fills *saved when saved && ctx.training.
  Tensor forward(const Context& ctx, const Tensor& x, Saved* saved) const;
  // dy [..., D] (any floating dtype) -> dx in the input's dtype; weight().grad += dw.
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved);

  const RmsNormConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  Param& weight() { return *weight_; }
  const Tensor& weight_value() const { return weight_->value; }

 private:
  RmsNormConfig cfg_;
  std::string path_;
  Param* weight_ = nullptr;
};

}  // namespace hlm
