// ops::softmax_* and ops::cross_entropy_*: FP64 references, large logits stay finite, gradients
// against central finite differences, ignore_index and the token count, bad targets.
#include <algorithm>
#include <cmath>

#include "ops/cross_entropy.h"
#include "ops/softmax.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

Tensor ref_softmax(const Tensor& x) {
  const auto v = x.to_f64_vector();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  std::vector<double> y(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < d; ++i) m = std::max(m, v[size_t(r * d + i)]);
    for (int64_t i = 0; i < d; ++i) s += std::exp(v[size_t(r * d + i)] - m);
    for (int64_t i = 0; i < d; ++i) y[size_t(r * d + i)] = std::exp(v[size_t(r * d + i)] - m) / s;
  }
  return Tensor::from_values(x.shape(), y, DType::f64);
}

TEST(OpsSoftmax, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{3, 5, 65}, Shape{2, 1000}}) {
      Tensor x = randn(s, dt, rng, 3.0);
      EXPECT_TRUE(close(ops::softmax_forward(x), ref_softmax(x), tolerance_for(dt)))
          << dtype_name(dt) << shape_str(s);
    }
  // Huge logits: max-subtracted, no overflow.
  Tensor x = Tensor::from_values({1, 3}, {1000.0, 1000.0, -1000.0}, DType::f32);
  EXPECT_TRUE(close(ops::softmax_forward(x),
                    Tensor::from_values({1, 3}, {0.5, 0.5, 0.0}, DType::f64), {1e-7, 1e-7}));
}

TEST(OpsSoftmax, GradientMatchesFiniteDifferences) {
  Rng rng(test_seed());
  for (Shape s : {Shape{1, 1}, Shape{4, 9}, Shape{2, 3, 6}}) {
    Tensor x = randn(s, DType::f64, rng, 2.0), probe = randn(s, DType::f64, rng);
    auto loss = [&] { return dot(ops::softmax_forward(x), probe); };
    EXPECT_TRUE(grad_check(loss, x, ops::softmax_backward(ops::softmax_forward(x), probe)));
  }
  Rng r2(test_seed() + 1);
  Tensor y = ops::softmax_forward(randn({3, 4}, DType::f32, r2));
  EXPECT_THROW(ops::softmax_backward(y, randn({3, 5}, DType::f32, r2)), Error);
  EXPECT_THROW(ops::softmax_forward(Tensor::zeros({3}, DType::i64)), Error);
}

// FP64 reference loss (mean over non-ignored) and count.
std::pair<double, int64_t> ref_ce(const Tensor& logits, const std::vector<int64_t>& tg,
                                  int64_t ignore) {
  const auto v = logits.to_f64_vector();
  const int64_t nv = logits.size(1);
  double sum = 0;
  int64_t count = 0;
  for (size_t t = 0; t < tg.size(); ++t) {
    if (tg[t] == ignore) continue;
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < nv; ++i) m = std::max(m, v[t * size_t(nv) + size_t(i)]);
    for (int64_t i = 0; i < nv; ++i) s += std::exp(v[t * size_t(nv) + size_t(i)] - m);
    sum += m + std::log(s) - v[t * size_t(nv) + size_t(tg[t])];
    ++count;
  }
  return {count ? sum / double(count) : 0.0, count};
}

std::vector<int64_t> random_targets(int64_t nt, int64_t nv, int64_t ignore, Rng& rng) {
  std::vector<int64_t> tg(static_cast<size_t>(nt));
  for (auto& t : tg) t = rng.uniform() < 0.25 ? ignore : int64_t(rng.below(uint64_t(nv)));
  return tg;
}

TEST(OpsCrossEntropy, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (auto [nt, nv] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {65, 1000}})
      for (int64_t ignore : {int64_t(-100), int64_t(0)}) {
        Tensor logits = randn({nt, nv}, dt, rng, 3.0);
        auto tg = random_targets(nt, nv, ignore, rng);
        for (DType idt : {DType::i64, DType::i32}) {
          Tensor targets = Tensor::from_vector<int64_t>({nt}, tg).to(idt);
          auto out = ops::cross_entropy_forward(logits, targets, ignore);
          auto [loss, count] = ref_ce(logits, tg, ignore);
          EXPECT_EQ(out.count, count);
          EXPECT_NEAR(out.loss, loss, (dt == DType::f32 ? 1e-5 : 1e-12) * std::max(1.0, loss))
              << dtype_name(dt) << " T=" << nt << " V=" << nv;
        }
      }
}

TEST(OpsCrossEntropy, GradientMatchesFiniteDifferencesAndIgnoredRowsAreZero) {
  Rng rng(test_seed());
  const int64_t nt = 6, nv = 7;
  Tensor logits = randn({nt, nv}, DType::f64, rng, 2.0);
  std::vector<int64_t> tg = {3, -100, 0, 6, -100, 2};
  Tensor targets = Tensor::from_vector<int64_t>({nt}, tg);
  auto loss = [&] { return ops::cross_entropy_forward(logits, targets).loss * 1.7; };
  auto out = ops::cross_entropy_forward(logits, targets);
  EXPECT_EQ(out.count, 4);
  Tensor d = ops::cross_entropy_backward(logits, targets, out, 1.7);
  EXPECT_TRUE(grad_check(loss, logits, d));
  for (int64_t i = 0; i < nv; ++i) {
    EXPECT_EQ(d.at({1, i}), 0.0);
    EXPECT_EQ(d.at({4, i}), 0.0);
  }
  // Each non-ignored row sums to 0: (sum softmax - 1) / count.
  for (int64_t t : {0, 2, 3, 5}) {
    double s = 0;
    for (int64_t i = 0; i < nv; ++i) s += d.at({t, i});
    EXPECT_NEAR(s, 0.0, 1e-14);
  }
  // f32 backward vs f64.
  Tensor l32 = logits.to(DType::f32);
  Tensor d32 = ops::cross_entropy_backward(l32, targets, ops::cross_entropy_forward(l32, targets));
  Tensor d64 = ops::cross_entropy_backward(logits, targets, out);
  EXPECT_TRUE(close(d32, d64, tolerance_for(DType::f32)));
}

TEST(OpsCrossEntropy, AllIgnoredAndLargeLogits) {
  Rng rng(test_seed());
  Tensor logits = randn({3, 5}, DType::f32, rng);
  Tensor targets = Tensor::from_vector<int64_t>({3}, {-100, -100, -100});
  auto out = ops::cross_entropy_forward(logits, targets);
  EXPECT_EQ(out.count, 0);
  EXPECT_EQ(out.loss, 0.0);
  Tensor d = ops::cross_entropy_backward(logits, targets, out);
  for (double v : d.to_f64_vector()) EXPECT_EQ(v, 0.0);
  Tensor big = Tensor::from_values({1, 3}, {1e4, -1e4, 0.0}, DType::f32);
  auto o2 = ops::cross_entropy_forward(big, Tensor::from_vector<int64_t>({1}, {1}));
  EXPECT_NEAR(o2.loss, 2e4, 1e-2);
  for (double v :
       ops::cross_entropy_backward(big, Tensor::from_vector<int64_t>({1}, {1}), o2).to_f64_vector())
    EXPECT_TRUE(std::isfinite(v));
}

// A batch's rows in chunks (the model's chunked head): each chunk's backward with the batch's
// count (mean_count) gives the rows of the whole batch's dlogits bit for bit, and the chunks' row
// losses summed in order give its loss.
TEST(OpsCrossEntropy, ChunksWithTheBatchCountEqualTheWholeBatch) {
  Rng rng(test_seed());
  const Tensor logits = randn({9, 6}, DType::f32, rng, 3.0);
  const Tensor targets = Tensor::from_vector<int64_t>({9}, {0, 5, -100, 2, 2, -100, 1, 4, 3});
  const auto whole = ops::cross_entropy_forward(logits, targets);
  const Tensor dwhole = ops::cross_entropy_backward(logits, targets, whole, 0.7);
  double sum = 0;
  for (int64_t r0 = 0; r0 < 9; r0 += 4) {
    const int64_t r1 = std::min<int64_t>(9, r0 + 4);
    const Tensor l = logits.slice(0, r0, r1).contiguous(), t = targets.slice(0, r0, r1);
    const auto part = ops::cross_entropy_forward(l, t);
    for (double v : part.row_loss.to_f64_vector()) sum += v;
    const Tensor d = ops::cross_entropy_backward(l, t, part, 0.7, whole.count);
    EXPECT_TRUE(testing::bit_equal(d, dwhole.slice(0, r0, r1).contiguous())) << r0;
  }
  EXPECT_EQ(sum / double(whole.count), whole.loss);
  testing::expect_error(
      [&] { ops::cross_entropy_backward(logits, targets, whole, 1.0, whole.count - 1); },
      "mean_count must be 0 or at least");
}

TEST(OpsCrossEntropy, BadTargets) {
  Rng rng(test_seed());
  Tensor logits = randn({3, 5}, DType::f32, rng);
  std::string msg;
  try {
    ops::cross_entropy_forward(logits, Tensor::from_vector<int64_t>({3}, {0, 5, 1}));
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("targets[1] = 5"), std::string::npos) << msg;
  EXPECT_THROW(ops::cross_entropy_forward(logits, Tensor::from_vector<int32_t>({3}, {0, -1, 1})),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(logits, Tensor::from_vector<int64_t>({2}, {0, 1})),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(logits, Tensor::from_values({3}, {0, 1, 2}, DType::f32)),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(randn({3}, DType::f32, rng),
                                          Tensor::from_vector<int64_t>({3}, {0, 1, 2})),
               Error);
  // ignore_index is respected when non-default: -100 is then out of range.
  EXPECT_THROW(
      ops::cross_entropy_forward(logits, Tensor::from_vector<int64_t>({3}, {0, -100, 1}), 4),
      Error);
}

}  // namespace
}  // namespace hlm
