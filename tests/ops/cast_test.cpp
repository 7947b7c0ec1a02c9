#include <gtest/gtest.h>

#include <cmath>

#include "ops/cast.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(OpsCast, SaturationModes) {
  Tensor x = Tensor::from_values({6}, {500.0, -1e6, 464.0, 70000.0, INFINITY, 1.0}, DType::f32);
  auto sat = ops::cast(x, DType::e4m3, Saturate::finite).to_f64_vector();
  EXPECT_EQ(sat, (std::vector<double>{448, -448, 448, 448, 448, 1}));
  auto nosat = ops::cast(x, DType::e4m3, Saturate::none).to_f64_vector();
  EXPECT_TRUE(std::isnan(nosat[0]) && std::isnan(nosat[1]) && std::isnan(nosat[3]));
  EXPECT_EQ(nosat[2], 448.0);  // a tie at the edge rounds to even (448), as in cuda_fp8.h
  auto e5 = ops::cast(x, DType::e5m2, Saturate::none).to_f64_vector();
  EXPECT_EQ(e5[0], 512.0);
  EXPECT_EQ(e5[1], -INFINITY);
  EXPECT_EQ(e5[3], INFINITY);
  EXPECT_THROW(ops::cast(Tensor::from_values({1}, {1}, DType::i32), DType::f32), Error);
  // Infinities keep their sign in the 16-bit formats; overflow goes to inf in f16.
  Tensor inf = Tensor::from_values({3}, {INFINITY, -INFINITY, 70000.0}, DType::f32);
  for (DType dt : {DType::f16, DType::bf16}) {
    auto r = ops::cast(inf, dt).to_f64_vector();
    EXPECT_EQ(r[0], INFINITY) << dtype_name(dt);
    EXPECT_EQ(r[1], -INFINITY) << dtype_name(dt);
  }
  EXPECT_EQ(ops::cast(inf, DType::f16).to_f64_vector()[2], INFINITY);
}

}  // namespace
}  // namespace hlm
