// The CPU reference of the elementwise activations (ops/activations.h). Inputs are checked by the
// front door (ops/activations.cpp): f32 or f64, one dtype, contiguous; outputs are allocated by it.
#pragma once

#include "core/tensor.h"
#include "ops/activations.h"

namespace hlm::ops::cpu {

// y = act(x).
void activation_forward(ActKind act, const Tensor& x, Tensor& y);
// dx = dy * act'(x).
void activation_backward(ActKind act, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace hlm::ops::cpu
