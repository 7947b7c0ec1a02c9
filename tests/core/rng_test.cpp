#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "testing.h"

namespace hlm {
namespace {

// Known-answer vectors of Philox-4x32-10 from the Random123 distribution (kat_vectors).
TEST(CoreRng, PhiloxKnownAnswers) {
  auto a = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(a, (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  auto b =
      philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(b, (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  auto c =
      philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(c, (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdcceBu, 0x5001e420u, 0x24126ea1u}));
}

TEST(CoreRng, ReproducibleAndStreamsDiffer) {
  Rng a(42), b(42), c(42, 1);
  for (int i = 0; i < 10; ++i) {
    const uint64_t x = a.next_u64();
    EXPECT_EQ(x, b.next_u64());
    EXPECT_NE(x, c.next_u64());
  }
  Rng d(42);
  d.set_counter(5);
  Rng e(42);
  for (int i = 0; i < 5; ++i) e.next_u32();
  EXPECT_EQ(d.next_u64(), e.next_u64());
}

TEST(CoreRng, NormalMomentsAndUniformRange) {
  Rng r(testing::test_seed());
  const int n = 200000;
  double s = 0, s2 = 0;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal();
    s += x, s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.02);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
  for (int i = 0; i < 1000; ++i) {
    const double u = r.uniform();
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    EXPECT_LT(r.below(7), 7u);
  }
  Tensor t = randn({3, 5}, DType::bf16, r, 2.0);
  EXPECT_EQ(t.dtype(), DType::bf16);
}

}  // namespace
}  // namespace hlm
