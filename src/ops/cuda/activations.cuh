// The CUDA side of the elementwise activations (ops/activations.h): host interface of
// activations.cu, includable from C++. The front door (ops/activations.cpp) checks the arguments
// (f32, f64 or bf16, one dtype, contiguous) and allocates the outputs. Default stream.
#pragma once

#include "core/tensor.h"
#include "ops/activations.h"

namespace hlm::ops::cuda {

void activation_forward(ActKind act, const Tensor& x, Tensor& y);
void activation_backward(ActKind act, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace hlm::ops::cuda
