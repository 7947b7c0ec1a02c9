// ops::rmsnorm_* and ops::gated_rmsnorm_*: forward against an FP64 loop reference (f32 and f64,
// odd sizes, 3-D input), gradients (dx, dgate, dw) against central finite differences, dw
// accumulation (+=), bad input.
#include <cmath>

#include "ops/rmsnorm.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

// FP64 reference: y = x / sqrt(mean(x^2) + eps) * w (* sigmoid(g)); also rstd.
std::pair<Tensor, Tensor> ref_rmsnorm(const Tensor& x, const Tensor* g, const Tensor& w,
                                      double eps) {
  const auto vx = x.to_f64_vector(), vw = w.to_f64_vector();
  const auto vg = g ? g->to_f64_vector() : std::vector<double>();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  std::vector<double> y(vx.size()), r(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += vx[size_t(i * d + j)] * vx[size_t(i * d + j)];
    r[size_t(i)] = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      const size_t k = size_t(i * d + j);
      y[k] = vx[k] * r[size_t(i)] * vw[size_t(j)];
      if (g) y[k] *= 1.0 / (1.0 + std::exp(-vg[k]));
    }
  }
  Shape lead = x.shape();
  lead.pop_back();
  return {Tensor::from_values(x.shape(), y, DType::f64), Tensor::from_values(lead, r, DType::f64)};
}

Tensor minus(const Tensor& a, const Tensor& b) {
  auto va = a.to_f64_vector(), vb = b.to_f64_vector();
  for (size_t i = 0; i < va.size(); ++i) va[i] -= vb[i];
  return Tensor::from_values(a.shape(), va, DType::f64);
}

TEST(OpsRmsNorm, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{65, 128}, Shape{3, 5, 33}}) {
      Tensor x = randn(s, dt, rng), w = randn({s.back()}, dt, rng);
      auto out = ops::rmsnorm_forward(x, w, 1e-5);
      auto [y, r] = ref_rmsnorm(x, nullptr, w, 1e-5);
      EXPECT_TRUE(close(out.y, y, tolerance_for(dt))) << dtype_name(dt) << shape_str(s);
      EXPECT_TRUE(close(out.rstd, r, tolerance_for(dt))) << dtype_name(dt) << shape_str(s);
      EXPECT_EQ(out.y.dtype(), dt);
    }
  // eps is inside the sqrt: a row of tiny values gives x / sqrt(eps)-ish, not x / |x|.
  Tensor x = Tensor::full({1, 4}, 1e-4, DType::f64), w = Tensor::full({4}, 1.0, DType::f64);
  auto out = ops::rmsnorm_forward(x, w, 1e-6);
  EXPECT_NEAR(out.y.at({0, 0}), 1e-4 / std::sqrt(1e-8 + 1e-6), 1e-12);
}

TEST(OpsRmsNorm, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  for (Shape s : {Shape{1, 1}, Shape{5, 7}, Shape{2, 3, 9}}) {
    Tensor x = randn(s, DType::f64, rng), w = randn({s.back()}, DType::f64, rng);
    Tensor probe = randn(s, DType::f64, rng);
    auto loss = [&] { return dot(ops::rmsnorm_forward(x, w, 1e-5).y, probe); };
    auto out = ops::rmsnorm_forward(x, w, 1e-5);
    Tensor dw0 = randn({s.back()}, DType::f64, rng);
    Tensor dw = dw0.clone();
    Tensor dx = ops::rmsnorm_backward(probe, x, w, out.rstd, dw);
    EXPECT_TRUE(grad_check(loss, x, dx)) << shape_str(s);
    EXPECT_TRUE(grad_check(loss, w, minus(dw, dw0))) << shape_str(s);  // dw accumulated (+=)
  }
}

TEST(OpsRmsNorm, BackwardF32MatchesF64) {
  Rng rng(test_seed());
  Tensor x = randn({9, 31}, DType::f32, rng), w = randn({31}, DType::f32, rng);
  Tensor dy = randn({9, 31}, DType::f32, rng);
  Tensor dw32 = Tensor::zeros({31}, DType::f32), dw64 = Tensor::zeros({31}, DType::f64);
  Tensor dx32 = ops::rmsnorm_backward(dy, x, w, ops::rmsnorm_forward(x, w).rstd, dw32);
  Tensor x64 = x.to(DType::f64), w64 = w.to(DType::f64), dy64 = dy.to(DType::f64);
  Tensor dx64 = ops::rmsnorm_backward(dy64, x64, w64, ops::rmsnorm_forward(x64, w64).rstd, dw64);
  EXPECT_TRUE(close(dx32, dx64, tolerance_for(DType::f32)));
  EXPECT_TRUE(close(dw32, dw64, tolerance_for(DType::f32)));
}

TEST(OpsRmsNorm, BadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({4, 6}, DType::f32, rng), w = randn({6}, DType::f32, rng);
  EXPECT_THROW(ops::rmsnorm_forward(x, randn({5}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::rmsnorm_forward(x, w.to(DType::f64)), Error);
  EXPECT_THROW(ops::rmsnorm_forward(Tensor::zeros({4, 6}, DType::i32), w), Error);
  EXPECT_THROW(ops::rmsnorm_forward(x, w, -1.0), Error);
  auto out = ops::rmsnorm_forward(x, w);
  Tensor dw = Tensor::zeros({6}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_backward(randn({4, 5}, DType::f32, rng), x, w, out.rstd, dw), Error);
  EXPECT_THROW(ops::rmsnorm_backward(x, x, w, randn({3}, DType::f32, rng), dw), Error);
  Tensor dw_bad = Tensor::zeros({7}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_backward(x, x, w, out.rstd, dw_bad), Error);
}

TEST(OpsGatedRmsNorm, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (Shape s : {Shape{1, 1}, Shape{11, 17}, Shape{6, 4, 64}}) {
      Tensor x = randn(s, dt, rng), g = randn(s, dt, rng, 3.0), w = randn({s.back()}, dt, rng);
      auto out = ops::gated_rmsnorm_forward(x, g, w, 1e-5);
      auto [y, r] = ref_rmsnorm(x, &g, w, 1e-5);
      EXPECT_TRUE(close(out.y, y, tolerance_for(dt))) << dtype_name(dt) << shape_str(s);
      EXPECT_TRUE(close(out.rstd, r, tolerance_for(dt)));
    }
  // Saturated gates give no NaN.
  Tensor x = Tensor::full({1, 3}, 2.0, DType::f32), w = Tensor::full({3}, 1.0, DType::f32);
  Tensor g = Tensor::from_values({1, 3}, {-1e4, 0.0, 1e4}, DType::f32);
  auto out = ops::gated_rmsnorm_forward(x, g, w);
  EXPECT_TRUE(
      close(out.y, Tensor::from_values({1, 3}, {0.0, 0.5 * 1.0, 1.0}, DType::f64), {1e-5, 1e-5}));
}

TEST(OpsGatedRmsNorm, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  for (Shape s : {Shape{1, 1}, Shape{5, 7}, Shape{3, 2, 8}}) {
    Tensor x = randn(s, DType::f64, rng), g = randn(s, DType::f64, rng, 2.0);
    Tensor w = randn({s.back()}, DType::f64, rng), probe = randn(s, DType::f64, rng);
    auto loss = [&] { return dot(ops::gated_rmsnorm_forward(x, g, w, 1e-5).y, probe); };
    auto out = ops::gated_rmsnorm_forward(x, g, w, 1e-5);
    Tensor dw0 = randn({s.back()}, DType::f64, rng);
    Tensor dw = dw0.clone();
    auto grads = ops::gated_rmsnorm_backward(probe, x, g, w, out.rstd, dw);
    EXPECT_TRUE(grad_check(loss, x, grads.dx)) << shape_str(s);
    EXPECT_TRUE(grad_check(loss, g, grads.dgate)) << shape_str(s);
    EXPECT_TRUE(grad_check(loss, w, minus(dw, dw0))) << shape_str(s);
  }
}

TEST(OpsGatedRmsNorm, BadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({4, 6}, DType::f32, rng), w = randn({6}, DType::f32, rng);
  EXPECT_THROW(ops::gated_rmsnorm_forward(x, randn({4, 5}, DType::f32, rng), w), Error);
  EXPECT_THROW(ops::gated_rmsnorm_forward(x, randn({4, 6}, DType::f64, rng), w), Error);
  Tensor g = randn({4, 6}, DType::f32, rng);
  auto out = ops::gated_rmsnorm_forward(x, g, w);
  Tensor dw = Tensor::zeros({6}, DType::f32);
  EXPECT_THROW(ops::gated_rmsnorm_backward(x, x, Tensor(), w, out.rstd, dw), Error);
}

}  // namespace
}  // namespace hlm
