#include <gtest/gtest.h>

#include <cstdint>

#include "core/arena.h"

namespace hlm {
namespace {

TEST(CoreArena, CarvesAlignedDisjointTensorsAndTracksPeak) {
  Arena a(1024);
  Tensor x = a.alloc({3, 5}, DType::f32);   // 60 bytes -> 64
  Tensor y = a.alloc({7}, DType::f64);      // 56 bytes -> 64
  Tensor z = a.alloc({2, 2}, DType::bf16);  // 8 bytes -> 64
  EXPECT_EQ(a.used(), 192u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(y.raw()) % 64, 0u);
  EXPECT_EQ(static_cast<char*>(y.raw()) - static_cast<char*>(x.raw()), 64);
  x.fill_(1.0), y.fill_(2.0), z.fill_(3.0);
  for (double v : x.to_f64_vector()) EXPECT_EQ(v, 1.0);
  for (double v : y.to_f64_vector()) EXPECT_EQ(v, 2.0);
  EXPECT_THROW(a.alloc({1000}, DType::f32), Error);
  a.reset();
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.peak(), 192u);
  Tensor w = a.alloc({4}, DType::f32);
  EXPECT_EQ(w.raw(), x.raw());  // the bytes are handed out again
  EXPECT_EQ(Arena::footprint({65}, DType::u8), 128u);
}

}  // namespace
}  // namespace hlm
