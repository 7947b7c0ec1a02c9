// ops::greedy_pick on the CPU against infer::sample_token's greedy choice (the same token and the
// same log-probability bits) on random rows, rows with ties (the lower id), one-token rows, and
// rows with a NaN or an infinite logit (the first such id reported); bad arguments refused.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "infer/sampling.h"
#include "ops/greedy.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(GreedyPick, EqualsTheSamplersGreedyChoice) {
  Rng rng(testing::test_seed());
  for (int64_t V : {1, 7, 1000, 4099}) {
    const int64_t R = 5;
    std::vector<float> x(size_t(R * V));
    for (auto& v : x) v = float(rng.normal() * 4.0);
    if (V > 3) {
      x[size_t(1 * V + 2)] = 50.f;  // row 1: a tie between ids 2 and V - 1
      x[size_t(1 * V + V - 1)] = 50.f;
    }
    const ops::GreedyPick p = ops::greedy_pick(Tensor::from_vector({R, V}, x));
    for (int64_t r = 0; r < R; ++r) {
      const infer::Sampled s = infer::sample_token(x.data() + r * V, V, {}, 0, 0);
      EXPECT_EQ(p.token.data<int64_t>()[r], s.token) << V << " " << r;
      EXPECT_EQ(p.logprob.data<double>()[r], s.logprob) << V << " " << r;
      EXPECT_EQ(p.bad.data<int64_t>()[r], -1);
    }
    if (V > 3) EXPECT_EQ(p.token.data<int64_t>()[1], 2);
  }
}

TEST(GreedyPick, ReportsTheFirstNonFiniteLogit) {
  std::vector<double> x = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // [3, 3]
  x[4] = NAN;
  x[6] = -INFINITY;
  x[8] = INFINITY;
  const ops::GreedyPick p = ops::greedy_pick(Tensor::from_vector<double>({3, 3}, x));
  EXPECT_EQ(p.bad.data<int64_t>()[0], -1);
  EXPECT_EQ(p.token.data<int64_t>()[0], 2);
  EXPECT_EQ(p.bad.data<int64_t>()[1], 1);
  EXPECT_EQ(p.bad.data<int64_t>()[2], 0);
  testing::expect_error([] { ops::greedy_pick(Tensor::zeros({4}, DType::f32)); },
                        "logits must be [R, V]");
  testing::expect_error(
      [] {
        ops::greedy_pick(Tensor::zeros({2, 0}, DType::f32));
      },
      "logits must be [R, V] with V >= 1");
  testing::expect_error(
      [] {
        ops::greedy_pick(Tensor::zeros({2, 3}, DType::i64));
      },
      "must be f32 or f64");
  EXPECT_EQ(ops::greedy_pick(Tensor::zeros({0, 3}, DType::f32)).token.numel(), 0);
}

}  // namespace
}  // namespace hlm
