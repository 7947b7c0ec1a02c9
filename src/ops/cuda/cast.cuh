// The CUDA side of cast (ops/cast.h): host interface of cast.cu, includable from C++. The front
// door (ops/cast.cpp) checks the arguments (x contiguous f32; y f32, bf16, f16, e4m3 or e5m2)
// and allocates y with x's shape. Default stream.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cuda {

void cast(const Tensor& x, Tensor& y, Saturate sat);

}  // namespace hlm::ops::cuda
