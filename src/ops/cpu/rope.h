// The CPU reference of RoPE (ops/rope.h). The front door (ops/rope.cpp) checks the arguments;
// tensors are contiguous, x and y f32 or f64 of one dtype and shape; y may be x (in place).
#pragma once

#include "core/tensor.h"
#include "ops/rope.h"

namespace hlm::ops::cpu {

void rope(const Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt,
          Tensor& y);

}  // namespace hlm::ops::cpu
