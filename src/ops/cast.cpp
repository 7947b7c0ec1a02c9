#include "ops/cast.h"

namespace hlm::ops {

Tensor cast(const Tensor& x, DType to, Saturate sat) {
  check_defined(x, "cast: x");
  HLM_CHECK(is_floating(x.dtype()) && is_floating(to), "cast: floating dtypes only, got {} -> {}",
            dtype_name(x.dtype()), dtype_name(to));
  if (x.device() == Device::cpu) {
    Tensor y = Tensor::empty(x.shape(), to);
    cpu::cast(x, y, sat);
    return y;
  }
#ifdef HLM_HAVE_CUDA
  HLM_CHECK(x.dtype() == DType::f32 && x.is_contiguous(),
            "cast on CUDA: x must be a contiguous f32 tensor, got {}", x.describe());
  Tensor y = Tensor::empty(x.shape(), to, Device::cuda);
  cuda::cast(x, y, sat);
  return y;
#else
  HLM_FAIL("cast: no CUDA support in this build");
#endif
}

namespace cpu {
void cast(const Tensor& x, Tensor& y, Saturate sat) {
  const bool fp8 = y.dtype() == DType::e4m3 || y.dtype() == DType::e5m2;
  if (!fp8 || sat == Saturate::finite) {
    y.copy_(x);  // Tensor conversions saturate fp8 to finite
    return;
  }
  const Fp8Format f = y.dtype() == DType::e4m3 ? Fp8Format::e4m3 : Fp8Format::e5m2;
  const std::vector<double> v = x.to_f64_vector();
  uint8_t* out = static_cast<uint8_t*>(y.raw());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_fp8(float(v[i]), f, sat);
}
}  // namespace cpu

}  // namespace hlm::ops
