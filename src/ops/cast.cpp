// The front door of cast (ops/cast.h): argument checks, output allocation, and the switch to the
// CPU reference (ops/cpu/cast.cpp) or the CUDA kernels (ops/cuda/cast.cu).
#include "ops/cast.h"

#include "ops/cpu/cast.h"
#include "ops/cuda/cast.cuh"
#include "ops/dispatch.h"

namespace hlm::ops {

Tensor cast(const Tensor& x_, DType to, Saturate sat) {
  constexpr const char* op = "cast";
  check_defined(x_, "cast: x");
  HLM_CHECK(is_floating(x_.dtype()) && is_floating(to), "cast: floating dtypes only, got {} -> {}",
            dtype_name(x_.dtype()), dtype_name(to));
  const Device dev = x_.device();
  if (dev == Device::cuda) {
    HLM_CHECK(x_.dtype() == DType::f32 && x_.is_contiguous(),
              "cast on CUDA: x must be a contiguous f32 tensor, got {}", x_.describe());
    HLM_CHECK(to == DType::f32 || to == DType::bf16 || to == DType::f16 || to == DType::e4m3 ||
                  to == DType::e5m2,
              "cast on CUDA: the target dtype must be f32, bf16, f16, e4m3 or e5m2, got {}",
              dtype_name(to));
  }
  const Tensor x = x_.contiguous();
  Tensor y = detail::new_output(x.shape(), to, dev);
  HLM_DISPATCH(op, dev, cast, x, y, sat);
  return y;
}

}  // namespace hlm::ops
