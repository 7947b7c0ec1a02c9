// The CPU reference of the KDA decay gate (ops/kda_gate.h). Inputs are checked by the front door
// (ops/kda_gate.cpp): z any floating dtype, A_log / dt_bias / dg read in the computation dtype
// (f64 for f64 z, else f32). Outputs are allocated by the front door in the computation dtype:
// g, and the grads dz, dA_log (when A_log is given) and ddt_bias (when dt_bias is given).
#pragma once

#include "core/tensor.h"
#include "ops/kda_gate.h"

namespace hlm::ops::cpu {

void kda_gate_forward(const KdaGateArgs& a, Tensor& g);
void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r);

}  // namespace hlm::ops::cpu
