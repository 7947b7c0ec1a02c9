// The CPU reference of the L2 normalisation (ops/l2norm.h). Inputs are checked by the front door
// (ops/l2norm.cpp): f32 or f64, one dtype; outputs are allocated by it.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cpu {

void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd);
void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx);

}  // namespace hlm::ops::cpu
