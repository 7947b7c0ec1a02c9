// The CUDA side of the KDA decay gate (ops/kda_gate.h): host interface of kda_gate.cu, includable
// from C++. The front door (ops/kda_gate.cpp) checks the arguments (z f32 / f64 / bf16; A_log,
// dt_bias and dg contiguous in the computation dtype) and allocates the outputs in the
// computation dtype: g, and the grads dz, dA_log (when A_log is given) and ddt_bias (when dt_bias
// is given). Kernels run on the default stream.
#pragma once

#include "core/tensor.h"
#include "ops/kda_gate.h"

namespace hlm::ops::cuda {

void kda_gate_forward(const KdaGateArgs& a, Tensor& g);
void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r);

}  // namespace hlm::ops::cuda
