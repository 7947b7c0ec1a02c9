// The CPU reference of the Hadamard rotation (ops/hadamard.h). The front door
// (ops/hadamard.cpp) checks the arguments; x and y contiguous, f32 or f64, one dtype and shape,
// the last dimension a power of two; y may be x (in place).
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cpu {

void hadamard(const Tensor& x, Tensor& y);

}  // namespace hlm::ops::cpu
