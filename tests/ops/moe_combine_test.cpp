// Tests of ops::moe_combine / moe_combine_backward: plain-loop references in the op's dtype and
// order (bit-exact) and in FP64, finite differences, and the argument checks.
#include <cmath>
#include <vector>

#include "ops/moe.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::expect_error;
using hlm::testing::test_seed;

// out[t, c] = sum_k w[t, k] eo[t, k, c] (+ shared[t, c]) in T, k ascending, shared last.
template <class T>
Tensor combine_ref(const Tensor& eo, const Tensor& w, const Tensor& shared) {
  const int64_t Tn = eo.size(0), K = eo.size(1), D = eo.size(2);
  const auto e = eo.to_f64_vector();
  const auto wv = w.defined() ? w.to_f64_vector() : std::vector<double>();
  const auto sv = shared.defined() ? shared.to_f64_vector() : std::vector<double>();
  std::vector<double> out(size_t(Tn * D));
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t c = 0; c < D; ++c) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const T v = T(e[size_t((t * K + k) * D + c)]);
        acc += w.defined() ? T(wv[size_t(t * K + k)]) * v : v;
      }
      if (shared.defined()) acc += T(sv[size_t(t * D + c)]);
      out[size_t(t * D + c)] = double(acc);
    }
  return Tensor::from_vector<double>({Tn, D}, out).to(eo.dtype());
}

TEST(OpsMoeCombine, MatchesLoopsBitExactAndFp64) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (bool with_w : {true, false})
      for (bool with_shared : {true, false}) {
        const int64_t Tn = 7, K = 3, D = 5;
        const Tensor eo = randn({Tn, K, D}, dt, rng);
        const Tensor w = with_w ? rand_uniform({Tn, K}, dt, rng, 0.1, 1.0) : Tensor();
        const Tensor sh = with_shared ? randn({Tn, D}, dt, rng) : Tensor();
        const Tensor out = moe_combine(eo, w, sh);
        ASSERT_EQ(out.shape(), Shape({Tn, D}));
        const Tensor ref =
            dt == DType::f64 ? combine_ref<double>(eo, w, sh) : combine_ref<float>(eo, w, sh);
        EXPECT_TRUE(bit_equal(out, ref))
            << dtype_name(dt) << " w " << with_w << " shared " << with_shared;
        const Tensor ref64 =
            combine_ref<double>(eo.to(DType::f64), w.defined() ? w.to(DType::f64) : Tensor(),
                                sh.defined() ? sh.to(DType::f64) : Tensor());
        EXPECT_TRUE(close(out, ref64, testing::tolerance_for(dt)));
      }
}

TEST(OpsMoeCombine, BackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t Tn = 4, K = 2, D = 3;
  Tensor eo = randn({Tn, K, D}, DType::f64, rng);
  Tensor w = rand_uniform({Tn, K}, DType::f64, rng, 0.1, 1.0);
  const Tensor sh = randn({Tn, D}, DType::f64, rng);
  const Tensor probe = randn({Tn, D}, DType::f64, rng);
  const MoeCombineGrads g = moe_combine_backward(probe, eo, w);
  ASSERT_EQ(g.dw.shape(), Shape({Tn, K}));
  ASSERT_EQ(g.deo.shape(), Shape({Tn, K, D}));
  auto loss = [&] { return testing::dot(moe_combine(eo, w, sh), probe); };
  EXPECT_TRUE(testing::grad_check(loss, w, g.dw));
  EXPECT_TRUE(testing::grad_check(loss, eo, g.deo));
}

TEST(OpsMoeCombine, RejectsBadArguments) {
  Rng rng(test_seed());
  const Tensor eo = randn({4, 2, 3}, DType::f32, rng);
  const Tensor w = randn({4, 2}, DType::f32, rng);
  expect_error([&] { moe_combine(eo.view({8, 3}), w); }, "eo must be [T, K, D]");
  expect_error([&] { moe_combine(eo, randn({4, 3}, DType::f32, rng)); }, "w must have shape");
  expect_error([&] { moe_combine(eo, w.to(DType::f64)); }, "w must have the dtype of eo");
  expect_error(
      [&] {
        moe_combine(eo, w, randn({4, 2}, DType::f32, rng));
      },
      "shared must have shape");
  expect_error([&] { moe_combine(eo.to(DType::bf16), Tensor()); }, "eo must be f32 or f64");
  expect_error(
      [&] {
        moe_combine_backward(randn({4, 3}, DType::f32, rng), eo, Tensor());
      },
      "w is undefined");
  expect_error(
      [&] {
        moe_combine_backward(randn({4, 2}, DType::f32, rng), eo, w);
      },
      "dout must have shape");
}

}  // namespace
}  // namespace hlm::ops
