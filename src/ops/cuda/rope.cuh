// The CUDA side of RoPE (ops/rope.h): host interface, includable from C++. The front door
// (ops/rope.cpp) checks the arguments (x f32 / f64 / bf16 contiguous, pos i64 [T], inv_freq f64
// [rope_dim / 2], all on the device) and allocates y; y may be x (in place). Default stream.
#pragma once

#include "core/tensor.h"
#include "ops/rope.h"

namespace hlm::ops::cuda {

void rope(const Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt,
          Tensor& y);

}  // namespace hlm::ops::cuda
