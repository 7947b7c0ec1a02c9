// The CPU reference of the softmax (ops/softmax.h). The front door (ops/softmax.cpp) checks the
// arguments and allocates the output; tensors are contiguous, f32 or f64, one dtype.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cpu {

void softmax_forward(const Tensor& x, Tensor& y);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);

}  // namespace hlm::ops::cpu
