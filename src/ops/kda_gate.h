// KDA decay gate (docs/kda.md, "The decay gate"): the log-space per-channel decay g of Kimi Delta
// Attention.
//   standard:    g = -exp(A_log[h]) * softplus(z + dt_bias)            g in (-inf, 0)
//   lower_bound: g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))       g in (lb, 0), lb in [-5, 0)
// softplus(x) returns x for x > 20 (as the GLM reference does). Forward and backward compute in
// FP32 (FP64 when z is f64). Backward reduces dA_log and d dt_bias over tokens in a fixed order
// (no atomics, bit-identical run to run). Products of a zero factor and an infinite one (saturated
// sigmoid with a huge exp(A_log)) are defined as 0, so no NaN appears.
// CUDA tensors run the CUDA implementation (also bf16; dtype rules in ops/op_checks.h).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

enum class KdaGateKind { standard, lower_bound };

// The lower-bound gate's bound lb lies in [kKdaLowerBoundMin, 0): the range in which the safe gate
// was trained and kept stable (Kimi Linear's safe gate; lb = -5 is its default, kKdaLowerBound).
// Every config, layer and op checks a bound with check_kda_lower_bound, the one place the range is
// written.
constexpr double kKdaLowerBoundMin = -5.0;
constexpr double kKdaLowerBound = -5.0;
// Throws hlm::Error "<where>: <what> must lie in [-5, 0), got <lb>" unless lb is in that range.
void check_kda_lower_bound(double lb, const char* where, const char* what = "lower_bound");

struct KdaGateArgs {
  Tensor z;        // [T, HV, K] raw gate logits (f32 or f64; other floats are computed in f32)
  Tensor A_log;    // [HV] (f32); optional for lower_bound (undefined: exp(A_log) = 1)
  Tensor dt_bias;  // [HV*K] (f32); optional (undefined: 0)
  KdaGateKind kind = KdaGateKind::lower_bound;
  double lower_bound = kKdaLowerBound;  // lower_bound kind only; check_kda_lower_bound
};

struct KdaGateGrads {
  Tensor dz;        // [T, HV, K], dtype of the computation
  Tensor dA_log;    // [HV] (undefined when A_log was undefined)
  Tensor ddt_bias;  // [HV*K] (undefined when dt_bias was undefined)
};

// g [T, HV, K] in the computation dtype (f64 when z is f64, else f32).
Tensor kda_gate(const KdaGateArgs& a);
// dg: [T, HV, K], gradient w.r.t. g.
KdaGateGrads kda_gate_backward(const KdaGateArgs& a, const Tensor& dg);

}  // namespace hlm::ops
