// cast: convert a floating tensor to another floating dtype, rounding to nearest even, with the
// fp8 saturation mode of cuda_fp8.h (Saturate::finite = __NV_SATFINITE, none = __NV_NOSAT).
// CPU and CUDA implementations agree bit for bit (the CUDA one uses the hardware cvt instructions
// where cuda_fp8.h does).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

Tensor cast(const Tensor& x, DType to, Saturate sat = Saturate::finite);

namespace cpu {
void cast(const Tensor& x, Tensor& y, Saturate sat);
}
namespace cuda {
void cast(const Tensor& x, Tensor& y, Saturate sat);  // x f32 contiguous; y bf16/f16/e4m3/e5m2
}

}  // namespace hlm::ops
