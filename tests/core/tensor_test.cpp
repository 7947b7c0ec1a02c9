#include <gtest/gtest.h>

#include "core/tensor.h"
#include "testing.h"

namespace hlm {
namespace {

Tensor iota(const Shape& s, DType dt) {
  std::vector<double> v(size_t(shape_numel(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i);
  return Tensor::from_values(s, v, dt);
}

TEST(CoreTensor, ContiguousLayoutAndViews) {
  Tensor t = iota({2, 3, 4}, DType::f32);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.at({1, 2, 3}), 23.0);
  Tensor v = t.view({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_TRUE(v.same_storage(t));
  EXPECT_EQ(v.at({5, 3}), 23.0);
  EXPECT_THROW(t.view({5, -1}), Error);
  EXPECT_THROW(t.view({-1, -1}), Error);
}

TEST(CoreTensor, SliceSelectTransposeMatchIndexArithmetic) {
  Tensor t = iota({3, 5, 7}, DType::f64);
  Tensor s = t.slice(1, 1, 4).select(2, 6).transpose(0, 1);  // [3(j), 3(i)]
  EXPECT_FALSE(s.is_contiguous());
  for (int64_t a = 0; a < 3; ++a)
    for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(s.at({a, b}), double(b * 35 + (a + 1) * 7 + 6));
  Tensor c = s.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_FALSE(c.same_storage(t));
  EXPECT_EQ(c.to_f64_vector(), s.to_f64_vector());
  EXPECT_THROW(t.slice(1, 3, 6), Error);
  EXPECT_THROW(t.select(0, 3), Error);
  EXPECT_THROW(t.transpose(0, 3), Error);
  EXPECT_THROW(s.view({9}), Error);  // non-contiguous
  EXPECT_EQ(s.reshape({9}).to_f64_vector(), c.to_f64_vector());
}

TEST(CoreTensor, SplitDimIsAViewOfAnyStrides) {
  Tensor t = iota({3, 10}, DType::f64);
  Tensor s = t.slice(1, 2, 8).split_dim(1, 3);  // [3, 2, 3] of the columns 2..7
  EXPECT_EQ(s.shape(), (Shape{3, 2, 3}));
  EXPECT_EQ(s.strides(), (Shape{10, 3, 1}));
  EXPECT_TRUE(s.same_storage(t));
  for (int64_t a = 0; a < 3; ++a)
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(s.at({a, b, c}), double(a * 10 + 2 + b * 3 + c));
  // A transposed dimension splits by its own stride.
  Tensor u = t.transpose(0, 1).split_dim(0, 5);  // [2, 5, 3]
  EXPECT_EQ(u.strides(), (Shape{5, 1, 10}));
  EXPECT_EQ(u.at({1, 2, 1}), double(1 * 10 + 7));
  EXPECT_THROW(t.split_dim(1, 4), Error);
  EXPECT_THROW(t.split_dim(2, 1), Error);
}

TEST(CoreTensor, AsStridedViewsTheStorageWithinItsBounds) {
  Tensor t = iota({4, 6}, DType::f64);
  Tensor v = t.slice(0, 1, 4).as_strided({3, 2}, {6, 2}, 1);  // from element 7, rows 6 apart
  EXPECT_TRUE(v.same_storage(t));
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(v.at({i, j}), double(7 + i * 6 + j * 2));
  EXPECT_EQ(t.as_strided({24}, {1}).to_f64_vector(), t.to_f64_vector());
  EXPECT_THROW(t.as_strided({25}, {1}), Error);  // past the storage
  EXPECT_THROW(t.slice(0, 3, 4).as_strided({7}, {1}), Error);
  EXPECT_THROW(t.as_strided({2, 2}, {-1, 1}), Error);        // negative stride
  EXPECT_THROW(t.as_strided({2, 2}, {1}), Error);            // sizes and strides disagree
  EXPECT_EQ(t.as_strided({0, 5}, {100, 1}, 23).numel(), 0);  // empty: nothing spanned
}

TEST(CoreTensor, CopyIntoStridedDestinationConverts) {
  Tensor dst = Tensor::zeros({4, 6}, DType::f64);
  Tensor src = iota({3, 4}, DType::bf16);
  Tensor window = dst.slice(0, 1, 4).slice(1, 2, 6);
  window.copy_(src);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 6; ++j) {
      const bool in = i >= 1 && j >= 2;
      EXPECT_EQ(dst.at({i, j}), in ? double((i - 1) * 4 + (j - 2)) : 0.0);
    }
  EXPECT_THROW(window.copy_(iota({4, 3}, DType::f32)), Error);
}

TEST(CoreTensor, DtypeConversionRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even gives 1.
  Tensor a = Tensor::from_values({3}, {1.0 + 0x1p-8, 1.0 + 3 * 0x1p-8, -2.5}, DType::f32);
  auto b = a.to(DType::bf16).to_f64_vector();
  EXPECT_EQ(b[0], 1.0);
  EXPECT_EQ(b[1], 1.0 + 0x1p-6);
  EXPECT_EQ(b[2], -2.5);
  Tensor ids = Tensor::from_values({2}, {7, -3}, DType::i64);
  EXPECT_EQ(ids.to(DType::i32).to_f64_vector(), (std::vector<double>{7, -3}));
}

TEST(CoreTensor, EmptyTensorsAreContiguousAndCopy) {
  Tensor e = Tensor::empty({3, 0, 4}, DType::f32);
  EXPECT_TRUE(e.is_contiguous());
  EXPECT_EQ(e.view({0, 4}).shape(), (Shape{0, 4}));
  Tensor c = e.to(DType::bf16);
  EXPECT_EQ(c.numel(), 0);
  EXPECT_TRUE(e.transpose(0, 2).is_contiguous());
}

TEST(CoreTensor, FillZeroAndChecks) {
  Tensor t = Tensor::empty({2, 3}, DType::f32);
  t.transpose(0, 1).fill_(1.5);
  for (double v : t.to_f64_vector()) EXPECT_EQ(v, 1.5);
  t.zero_();
  for (double v : t.to_f64_vector()) EXPECT_EQ(v, 0.0);
  EXPECT_THROW(check_shape(t, {3, 2}, "x"), Error);
  EXPECT_THROW(check_dtype(t, DType::f64, "x"), Error);
  EXPECT_THROW(t.data<double>(), Error);
  try {
    check_shape(t, {3, 2}, "weights");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weights: expected shape [3, 2], got [2, 3]"),
              std::string::npos);
  }
}

TEST(CoreTensor, BitcastIsAViewOfTheSameBytes) {
  const Tensor t = Tensor::from_vector<int64_t>({2, 2}, {0, int64_t(0x3ff0000000000000), 3, 4});
  const Tensor d = t.select(0, 0).bitcast(DType::f64);
  EXPECT_TRUE(d.same_storage(t));
  EXPECT_EQ(d.dtype(), DType::f64);
  EXPECT_EQ(d.shape(), Shape({2}));
  EXPECT_EQ(d.data<double>()[1], 1.0);  // the bits of 1.0
  testing::expect_error([&] { (void)t.bitcast(DType::f32); }, "8-byte elements, f32 has 4");
}

}  // namespace
}  // namespace hlm
