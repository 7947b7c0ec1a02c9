// cast on the CPU (ops/cast.h, the reference; entry point in ops/cpu/cast.h): Tensor's own
// conversions (round to nearest even, fp8 saturating to finite), and float_to_fp8 for the
// non-saturating fp8 mode.
#include "ops/cpu/cast.h"

#include <vector>

namespace hlm::ops::cpu {

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

}  // namespace hlm::ops::cpu
