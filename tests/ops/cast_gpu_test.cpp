// GPU cast vs the CPU conversions: bit-identical on every fp8 code neighbourhood, special values
// and random values, for both saturation modes. Skips when no GPU is present.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ops/cast.h"
#include "testing.h"

namespace hlm {
namespace {

std::vector<double> interesting_values(uint64_t seed) {
  std::vector<double> v = {0.0,
                           -0.0,
                           1.0,
                           -1.0,
                           448.0,
                           464.0,
                           464.0001,
                           480.0,
                           57344.0,
                           61439.0,
                           61440.0,
                           65504.0,
                           65520.0,
                           1e30,
                           -1e30,
                           0x1p-9,
                           0x1p-10,
                           0x1.8p-10,
                           0x1p-16,
                           0x1p-17,
                           0x1.8p-17,
                           0x1p-18,
                           1e-40,
                           std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity(),
                           std::nan("")};
  // Every fp8 value and the midpoints to its neighbours (ties), in both formats.
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2})
    for (int c = 0; c < 256; ++c) {
      const double a = fp8_to_float(uint8_t(c), f), b = fp8_to_float(uint8_t(c + 1), f);
      v.push_back(a);
      if (std::isfinite(a) && std::isfinite(b) && (c & 0x7f) != 0x7f) v.push_back((a + b) / 2);
    }
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const double mag = std::ldexp(1.0, int(rng.below(60)) - 30);
    v.push_back(rng.normal() * mag);
  }
  return v;
}

TEST(OpsCastGpu, MatchesCpuBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const auto vals = interesting_values(testing::test_seed());
  Tensor x = Tensor::from_values({int64_t(vals.size())}, vals, DType::f32);
  Tensor xd = x.to(Device::cuda);
  for (DType dt : {DType::bf16, DType::f16, DType::e4m3, DType::e5m2})
    for (Saturate sat : {Saturate::finite, Saturate::none}) {
      if ((dt == DType::bf16 || dt == DType::f16) && sat == Saturate::none) continue;
      Tensor cpu = ops::cast(x, dt, sat);
      Tensor gpu = ops::cast(xd, dt, sat).to(Device::cpu);
      EXPECT_TRUE(testing::bit_equal(gpu, cpu))
          << dtype_name(dt) << (sat == Saturate::finite ? " satfinite" : " nosat");
    }
}

}  // namespace
}  // namespace hlm
