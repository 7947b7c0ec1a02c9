// The CPU reference of cast (ops/cast.h). The front door (ops/cast.cpp) checks the dtypes
// (floating) and allocates y with x's shape.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cpu {

// y = x converted to y's dtype, rounding to nearest even; fp8 targets saturate as `sat` says.
void cast(const Tensor& x, Tensor& y, Saturate sat);

}  // namespace hlm::ops::cpu
