// The CPU copy / elementwise ops of ops/tensor_ops.h (the CUDA versions are compared with these
// in tensor_ops_gpu_test.cpp): conversions, strided copies, add_, add_bias_, sum_rows, scale_ and
// the final conv state gradient scatter against plain loops, and their argument errors.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(TensorOps, ElementwiseAgainstLoops) {
  Rng rng(testing::test_seed());
  const Tensor a = randn({5, 7}, DType::f32, rng), b = randn({5, 7}, DType::f64, rng);
  EXPECT_TRUE(ops::as_dtype(a, DType::f32).same_storage(a));
  EXPECT_TRUE(testing::bit_equal(ops::as_dtype(a, DType::bf16), a.to(DType::bf16)));
  EXPECT_TRUE(ops::contiguous(a.transpose(0, 1)).is_contiguous());
  Tensor s = a.clone();
  ops::add_(s, b);
  const Tensor bias = randn({7}, DType::f32, rng);
  ops::add_bias_(s, bias);
  const auto va = a.to_f64_vector(), vb = b.to_f64_vector(), vbias = bias.to_f64_vector();
  const auto vs = s.to_f64_vector();
  for (int64_t i = 0; i < 35; ++i) {
    const float e = (float(va[size_t(i)]) + float(vb[size_t(i)])) + float(vbias[size_t(i % 7)]);
    EXPECT_EQ(float(vs[size_t(i)]), e) << i;
  }
  const auto sum = ops::sum_rows(s, DType::f64).to_f64_vector();
  for (int64_t o = 0; o < 7; ++o) {
    double e = 0;
    for (int64_t t = 0; t < 5; ++t) e += double(float(vs[size_t(t * 7 + o)]));
    EXPECT_EQ(sum[size_t(o)], e);
  }
  Tensor sc = s.clone();
  ops::scale_(sc, 0.5);
  const auto vsc = sc.to_f64_vector();
  for (int64_t i = 0; i < 35; ++i) EXPECT_EQ(vsc[size_t(i)], vs[size_t(i)] * 0.5);
  Tensor bad = Tensor::zeros({5, 6}, DType::f32);
  EXPECT_THROW(ops::add_(bad, a), Error);
  EXPECT_THROW(ops::add_bias_(s, bad), Error);
}

TEST(TensorOps, FinalConvStateBackward) {
  // Sequences of lengths 1 and 5, W = 4 (3 state entries): sequence 0's entries 0, 1 come from
  // the initial state (positions -2, -1), entry 2 from token 0; sequence 1's from tokens 3, 4, 5.
  const std::vector<int64_t> cu = {0, 1, 6};
  Tensor dfin = Tensor::zeros({2, 3, 1}, DType::f32);
  for (int64_t i = 0; i < 6; ++i) dfin.data<float>()[i] = float(i + 1);
  Tensor dx = Tensor::zeros({6, 1}, DType::f32), di = Tensor::zeros({2, 3, 1}, DType::f32);
  ops::causal_conv1d_final_state_backward(dfin, cu, 4, dx, &di);
  EXPECT_EQ(dx.to_f64_vector(), (std::vector<double>{3, 0, 0, 4, 5, 6}));
  EXPECT_EQ(di.to_f64_vector(), (std::vector<double>{0, 1, 2, 0, 0, 0}));
}

TEST(TensorOps, NanIfFlagged) {
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    const Tensor a = randn({3, 4}, DType::f32, rng).to(dt);
    Tensor b = a.clone();
    ops::nan_if_flagged_(b, Tensor::zeros({1}, DType::i32));
    EXPECT_TRUE(testing::bit_equal(a, b));
    ops::nan_if_flagged_(b, Tensor::full({1}, 1, DType::i32));
    for (double v : b.to_f64_vector()) EXPECT_TRUE(std::isnan(v));
  }
  Tensor t = Tensor::zeros({2}, DType::f32);
  testing::expect_error([&] { ops::nan_if_flagged_(t, Tensor::zeros({2}, DType::i32)); },
                        "flag must be an i32 [1] tensor");
  testing::expect_error([&] { ops::nan_if_flagged_(t, Tensor::zeros({1}, DType::i64)); },
                        "flag must be an i32 [1] tensor");
}

}  // namespace
}  // namespace hlm
