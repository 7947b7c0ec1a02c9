// The CUDA side of the Hadamard rotation (ops/hadamard.h): host interface, includable from C++.
// The front door (ops/hadamard.cpp) checks the arguments (f32 / f64 / bf16, contiguous, last
// dimension a power of two) and allocates y; y may be x (in place). Default stream.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cuda {

void hadamard(const Tensor& x, Tensor& y);

}  // namespace hlm::ops::cuda
