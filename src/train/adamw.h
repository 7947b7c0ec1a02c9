// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization") with FP32 master weights,
// global gradient-norm clipping and a named-tensor state for bit-exact resume.
//
// One update at step t (t = number of updates done after this one, 1-based) and learning rate lr,
// evaluated per element in FP64 from the stored values (docs/training.md):
//   n      = sqrt(sum_p sum_i grad_pi^2)                     global norm, FP64, fixed order
//   c      = max_grad_norm / n  if max_grad_norm > 0 and n > max_grad_norm, else 1
//   g      = c * grad
//   m      = beta1 * m + (1 - beta1) * g                      stored (FP32, or FP64 for f64 params)
//   v      = beta2 * v + (1 - beta2) * g^2                    stored
//   w      = w * (1 - lr * weight_decay)                      only where weight decay applies
//   w      = w - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//   value  = round_to_nearest_even(w)                          for bf16 / f16 parameters
// w is the master weight: FP32 for f32, bf16 and f16 parameters (for f32 parameters the master is
// the parameter's own storage), FP64 for f64 parameters (exact tests). m and v have the master's
// dtype. Gradients are read, never modified (the clip factor is folded into the update).
//
// Weight decay applies to a parameter unless weight_decay == 0, the parameter is flagged
// no_weight_decay or keep_fp32, or it has fewer than 2 dimensions (norm weights, biases, scalars)
// and decay_1d is false. weight_decay_decision() states the rule for one parameter.
//
// A non-finite gradient norm changes nothing (no update, the step count stays): step() reports it
// and the trainer decides whether to stop or to skip the batch.
//
// Determinism: the norm sums each parameter's squares in blocks of kNormBlock elements (each block
// sequentially, in row-major order), adds the block sums in order, then adds the parameters in the
// order given; the elementwise update has no reductions. Results do not depend on the thread count.
//
// Devices: a parameter on CUDA keeps its master and moments on the device and is updated there
// (train/cuda/adamw.cuh) with the same FP64 arithmetic, block order and rounding, so CPU and CUDA
// give the same bits; its gradient must be on the same device. f16 parameters are CPU-only.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "layers/module.h"

namespace hlm::train {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;  // <= 0: no clipping (the norm is still computed and reported)
  bool decay_1d = false;       // true: parameters with < 2 dimensions decay too
};

// Whether weight decay applies to a parameter, and why (a short phrase for logs and tests).
struct DecayDecision {
  bool decay = false;
  const char* reason = "";  // "decayed", "weight_decay is 0", "no_weight_decay", "keep_fp32",
                            // "fewer than 2 dimensions"
};
DecayDecision weight_decay_decision(const Param& p, const AdamWConfig& cfg);

struct GradNorm {
  double norm = 0;        // global L2 norm of the gradients before clipping
  double clip_scale = 1;  // factor the update applies to the gradients (1: no clipping)
  bool finite = true;     // false: a gradient holds NaN or Inf (or the sum overflowed)
};

struct StepResult {
  double grad_norm = 0;
  double clip_scale = 1;
  bool finite = true;    // false: nothing was updated
  bool applied = false;  // the update was made (== finite)
  int64_t step = 0;      // updates done after this call
};

class AdamW {
 public:
  static constexpr int64_t kNormBlock = 65536;

  // params: (full name, parameter) in a fixed order, e.g. Module::named_parameters(). Each value
  // must be a contiguous tensor of dtype f64, f32, bf16 or f16 (keep_fp32: f32 or f64; f16 on the
  // CPU only), on the CPU or a GPU; names are unique. The masters are initialised from the current
  // values.
  AdamW(std::vector<std::pair<std::string, Param*>> params, AdamWConfig cfg = {});

  const AdamWConfig& config() const { return cfg_; }
  int64_t step_count() const { return step_; }
  size_t size() const { return slots_.size(); }
  const std::string& name(size_t i) const { return slots_.at(i).name; }
  const DecayDecision& decision(size_t i) const { return slots_.at(i).decision; }
  const DecayDecision& decision(const std::string& name) const;

  // The global gradient norm and clip factor; every parameter must have a gradient of its shape
  // (f32 or f64). Gradients are not modified.
  GradNorm grad_norm() const;
  // The sum of the squared gradients (the norm before its square root), in the norm's order, and
  // the norm and clip factor of a sum of squares: a distributed optimizer adds its shards' sums
  // (train/data_parallel.h).
  double grad_sum_squares() const;
  // The same per parameter (its blocks in order), in the parameters' order; grad_sum_squares adds
  // them in that order. (Tensor parallelism adds the sliced parameters' over the group.)
  std::vector<double> grad_sum_squares_per_param() const;
  GradNorm grad_norm_from(double sum_squares) const;
  // One AdamW update at learning rate lr (finite, >= 0), unless the gradient norm is not finite;
  // the second form takes the norm (and clip factor) from the caller.
  StepResult step(double lr);
  StepResult step(double lr, const GradNorm& norm);

  // The optimizer's state of one parameter (views of the live tensors).
  const Tensor& master(const std::string& name) const;
  const Tensor& exp_avg(const std::string& name) const;
  const Tensor& exp_avg_sq(const std::string& name) const;

  // Re-read the masters from the parameter values (after the values were overwritten, e.g. by
  // loading model weights without optimizer state). Moments and step are kept.
  void sync_master_from_params();

  // The state as named tensors: "<prefix>step" (i64 scalar), "<prefix>master.<name>",
  // "<prefix>exp_avg.<name>", "<prefix>exp_avg_sq.<name>". The tensors of CPU parameters are views
  // of the live state (no copy): serialise the map before the next step(); those of CUDA
  // parameters are host copies.
  safetensors::TensorMap state_dict(const std::string& prefix = "optimizer.") const;
  // The three per-parameter kinds of state_dict's names, in that order.
  static constexpr const char* kStateKinds[] = {"master.", "exp_avg.", "exp_avg_sq."};
  // The parameter name of a state key "<prefix><kind><name>" ("" for "<prefix>step" and keys of
  // no kind; no kind is a prefix of another). key must start with prefix.
  static std::string state_param(const std::string& key, const std::string& prefix);
  // Restore a state written by state_dict(). Entries outside `prefix` are ignored (a checkpoint may
  // hold model weights too). Every parameter needs its three tensors with its shape and master
  // dtype, no tensor under `prefix` may be unknown, and every value must be finite; otherwise
  // hlm::Error names the tensor. Then every parameter value is set from its master (the master is
  // authoritative), so a resumed run continues bit-identically.
  void load_state_dict(const safetensors::TensorMap& state,
                       const std::string& prefix = "optimizer.");

 private:
  struct Slot {
    std::string name;
    Param* param = nullptr;
    Tensor master;  // f32 or f64; for f32 / f64 parameters the value itself
    Tensor m, v;    // master dtype
    bool separate_master = false;
    DecayDecision decision;
  };
  const Slot& slot(const std::string& name) const;
  void write_back(Slot& s);  // parameter value <- master (rounded)

  std::vector<Slot> slots_;
  AdamWConfig cfg_;
  int64_t step_ = 0;
};

}  // namespace hlm::train
