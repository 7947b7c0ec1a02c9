// Module: the parameter container every layer derives from.
//
// Conventions of every layer (docs/architecture.md, "Conventions that hold everywhere"):
//  - Explicit forward and backward, no autograd: forward(ctx, inputs, saved*) fills a named Saved
//    struct with exactly what backward needs; backward(ctx, grads, saved) returns the activation
//    gradients (written, =) and accumulates parameter gradients into Param::grad (+=).
//  - Parameter names are the HF checkpoint names relative to the module (e.g. "q_proj.weight").
//  - keep_fp32 parameters (A_log, dt_bias, mHC fn/base/scale, KPool ape, router bias) stay FP32
//    through to_dtype(), the optimizer and checkpoints.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace hlm {

struct Context {
  bool training = true;    // false: forward need not fill Saved
  bool recompute = false;  // selective recompute: Saved keeps only the layer input
};

struct Param {
  std::string name;  // relative to the module that owns it
  Tensor value;
  Tensor grad;  // same shape; f64 for f64 values, else f32; accumulated (+=) by backward
  bool keep_fp32 = false;
  bool no_weight_decay = false;
};

class Module {
 public:
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module() = default;

  // (full name, param) for this module and its children, children prefixed with "child.".
  std::vector<std::pair<std::string, Param*>> named_parameters(const std::string& prefix = "");
  Param* find_parameter(const std::string& full_name);  // nullptr when absent
  int64_t parameter_count();

  // Cast every parameter except keep_fp32 ones to dt (floating dtypes); grads are re-allocated.
  void to_dtype(DType dt);
  // Move every parameter value (and every defined gradient) to dev, keeping dtypes and values;
  // parameters already on dev are left as they are. The layers then run on that device.
  void to(Device dev);
  // Allocate (if needed) and zero every gradient.
  void zero_grad();
  // Inference: every weight that only bf16 GEMMs read (GemmKind::bf16) is kept in bf16, on its
  // device, and its gradient dropped. Such a GEMM rounds its weight to bf16 anyway, so every result
  // keeps its bits, and the weights take half the memory and half the bytes read per step (no
  // per-call conversion). Not for training: the optimizer needs the f32 values. The default
  // recurses into the children; the modules that own such weights override it.
  virtual void keep_gemm_weights_in_bf16();

 protected:
  Param& add_param(const std::string& name, Tensor value, bool keep_fp32 = false,
                   bool no_weight_decay = false);
  void add_child(const std::string& name, Module* child);

 private:
  std::vector<std::unique_ptr<Param>> params_;
  std::vector<std::pair<std::string, Module*>> children_;
};

// The gradient dtype that goes with a parameter dtype (f64 for f64, else f32).
inline DType grad_dtype_for(DType value_dt) {
  return compute_dtype(value_dt);
}

// p.grad, allocated as zeros (grad_dtype_for, on the value's device) when undefined, for a
// backward to accumulate into. A gradient set from outside must be contiguous, f32 or f64, of the
// value's shape and device; anything else is an hlm::Error naming `owner` and the parameter.
Tensor& ensure_grad(Param& p, std::string_view owner);

// The Philox stream of a parameter drawn by its full name (e.g. "model.layers.0.mlp.down_proj"):
// FNV-1a of the name, so each parameter's draws depend on its name only.
uint64_t name_stream(std::string_view full_name);
// Fill a CPU parameter with N(0, std^2): FP64 draws from (seed, name_stream(full_name)), one
// rounding to the parameter's dtype. first: the element of the named parameter that value's first
// element is (a part of it held here, e.g. one rank's experts): the same values as that part of
// the whole parameter.
void init_normal_named(Tensor& value, uint64_t seed, std::string_view full_name, double std,
                       uint64_t first = 0);

}  // namespace hlm
