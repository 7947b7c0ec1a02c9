// DenseMlp: the SwiGLU feed-forward block with the GLM clamp (docs/mhc_moe.md, "MoE"). Used for
// the leading dense layers (role ModuleRole::dense_mlp, "model.layers.0.mlp") and as the MoE shared
// expert (role ModuleRole::moe_expert, "model.layers.3.mlp.shared_experts").
//
//   g = x Wg^T,  u = x Wu^T                     gate_proj, up_proj: [I, D]
//   g' = min(g, L),  u' = clamp(u, -L, L)       swiglu_limit L (GLM-5.3: 10; L <= 0 or inf: none)
//   h = silu(g') * u'
//   y = h Wd^T                                  down_proj: [D, I]
//
// Conventions (docs/architecture.md): explicit forward and backward, no autograd. forward() fills
// Saved (the three Linear::Saved and the pre-activations gu = [g | u]); under ctx.recompute only
// the input is kept and backward recomputes g, u and h (bit for bit: every step is deterministic).
// backward() writes dx (=) and accumulates every weight gradient (+=) into Param::grad. On CPU or
// CUDA tensors (the parameters' device, Module::to; x and dy must be there too).
//
// Parameters (HF names relative to the module path): gate_proj.weight [I, D], up_proj.weight [I,
// D], down_proj.weight [D, I]; no biases. Init: N(0, init_std) from cfg.seed, one Philox stream per
// parameter derived from its FULL name (path + "." + name), so modules with one seed differ.
//
// Precision: the three GEMMs are Linear with the precision the PrecisionPolicy resolves for
// path + ".gate_proj" etc. and the module's role (native / bf16 / fp8_block, layers/linear.h).
// Compute dtype f64 when x is f64, else f32: x is converted once, the Linear outputs, the clamp and
// SwiGLU are in the compute dtype (a bf16 or fp8 GEMM rounds its operands itself), and y and dx are
// rounded once to x's dtype. Every step is per token: a packed batch gives its sequences' rows.
#pragma once

#include <cstdint>
#include <string>

#include "layers/linear.h"
#include "layers/module.h"
#include "layers/precision.h"

namespace hlm {

struct DenseMlpConfig {
  int64_t hidden_size = 0;        // D
  int64_t intermediate_size = 0;  // I
  double swiglu_limit = 10.0;     // GLM clamp; <= 0 or infinite: no clamp (DeepSeek-V3)
  DType dtype = DType::f32;       // parameter dtype: f64, f32 or bf16
  uint64_t seed = 0;              // deterministic init
  double init_std = 0.02;         // N(0, init_std) (HF initializer_range)

  // Throws hlm::Error naming the field: sizes < 1, swiglu_limit NaN, dtype not f64/f32/bf16,
  // init_std < 0 or not finite.
  void validate() const;
};

class DenseMlp : public Module {
 public:
  struct Saved {
    Tensor x;  // input in the compute dtype (always kept)
    DType x_dtype = DType::f32;
    bool recomputed = false;  // true: the fields below are empty, backward recomputes them
    Linear::Saved gate, up, down;
    Tensor gu;  // [T, 2I] = [g | u], compute dtype
  };

  // Validates cfg, resolves the three GEMM precisions from policy with the full path `path`
  // (e.g. "model.layers.0.mlp") and `role`, initialises the weights.
  DenseMlp(const DenseMlpConfig& cfg, const PrecisionPolicy& policy, const std::string& path,
           ModuleRole role = ModuleRole::dense_mlp);

  // x [T, D] f64/f32/bf16 -> y [T, D] in x's dtype. Fills *saved when saved && ctx.training.
  Tensor forward(const Context& ctx, const Tensor& x, Saved* saved) const;
  // dy [T, D] (any floating dtype) -> dx [T, D] in x's dtype; weight grads +=.
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved);

  const DenseMlpConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  ModuleRole role() const { return role_; }
  Linear& gate_proj() { return gate_; }
  Linear& up_proj() { return up_; }
  Linear& down_proj() { return down_; }

 private:
  void run_forward(const Context& ctx, const Tensor& xc, Saved& s, Tensor* y) const;

  DenseMlpConfig cfg_;
  std::string path_;
  ModuleRole role_;
  Linear gate_, up_, down_;
};

}  // namespace hlm
