// cast: convert a floating tensor to another floating dtype, rounding to nearest even, with the
// fp8 saturation mode of cuda_fp8.h (Saturate::finite = __NV_SATFINITE, none = __NV_NOSAT).
// CPU and CUDA implementations agree bit for bit (the CUDA one uses the hardware cvt instructions
// where cuda_fp8.h does).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

Tensor cast(const Tensor& x, DType to, Saturate sat = Saturate::finite);

}  // namespace hlm::ops
