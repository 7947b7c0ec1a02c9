// ops::l2norm_* and ops::layernorm_*: forward against FP64 loop references (f32, f64, odd
// sizes), gradients against central finite differences, dw / db accumulation, bad input.
#include <cmath>

#include "ops/l2norm.h"
#include "ops/layernorm.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

Tensor minus(const Tensor& a, const Tensor& b) {
  auto va = a.to_f64_vector(), vb = b.to_f64_vector();
  for (size_t i = 0; i < va.size(); ++i) va[i] -= vb[i];
  return Tensor::from_values(a.shape(), va, DType::f64);
}

Tensor ref_l2norm(const Tensor& x, double eps) {
  const auto v = x.to_f64_vector();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  std::vector<double> y(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += v[size_t(r * d + i)] * v[size_t(r * d + i)];
    for (int64_t i = 0; i < d; ++i)
      y[size_t(r * d + i)] = v[size_t(r * d + i)] / std::sqrt(ss + eps);
  }
  return Tensor::from_values(x.shape(), y, DType::f64);
}

TEST(OpsL2Norm, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{63, 128}, Shape{5, 3, 65}}) {
      Tensor x = randn(s, dt, rng);
      auto out = ops::l2norm_forward(x);
      EXPECT_TRUE(close(out.y, ref_l2norm(x, 1e-6), tolerance_for(dt)))
          << dtype_name(dt) << shape_str(s);
    }
  // eps inside the sqrt: a tiny vector is not blown up to unit norm.
  Tensor x = Tensor::full({1, 2}, 1e-5, DType::f64);
  EXPECT_NEAR(ops::l2norm_forward(x).y.at({0, 0}), 1e-5 / std::sqrt(2e-10 + 1e-6), 1e-13);
}

TEST(OpsL2Norm, GradientMatchesFiniteDifferences) {
  Rng rng(test_seed());
  for (Shape s : {Shape{1, 1}, Shape{4, 9}, Shape{2, 3, 16}}) {
    Tensor x = randn(s, DType::f64, rng), probe = randn(s, DType::f64, rng);
    auto loss = [&] { return dot(ops::l2norm_forward(x).y, probe); };
    Tensor dx = ops::l2norm_backward(probe, x, ops::l2norm_forward(x).rstd);
    EXPECT_TRUE(grad_check(loss, x, dx)) << shape_str(s);
  }
}

TEST(OpsL2Norm, BadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({3, 4}, DType::f32, rng);
  EXPECT_THROW(ops::l2norm_forward(Tensor::zeros({3, 4}, DType::i64)), Error);
  EXPECT_THROW(ops::l2norm_forward(x, -1e-6), Error);
  auto out = ops::l2norm_forward(x);
  EXPECT_THROW(ops::l2norm_backward(randn({3, 5}, DType::f32, rng), x, out.rstd), Error);
  EXPECT_THROW(ops::l2norm_backward(x, x, randn({4}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::l2norm_backward(x.to(DType::f64), x, out.rstd), Error);
}

struct LnRef {
  Tensor y, mean, rstd;
};
LnRef ref_layernorm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const auto v = x.to_f64_vector(), vw = w.to_f64_vector(), vb = b.to_f64_vector();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  std::vector<double> y(v.size()), m(static_cast<size_t>(rows)), r(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0, q = 0;
    for (int64_t j = 0; j < d; ++j) s += v[size_t(i * d + j)];
    m[size_t(i)] = s / double(d);
    for (int64_t j = 0; j < d; ++j) q += std::pow(v[size_t(i * d + j)] - m[size_t(i)], 2);
    r[size_t(i)] = 1.0 / std::sqrt(q / double(d) + eps);
    for (int64_t j = 0; j < d; ++j)
      y[size_t(i * d + j)] =
          (v[size_t(i * d + j)] - m[size_t(i)]) * r[size_t(i)] * vw[size_t(j)] + vb[size_t(j)];
  }
  Shape lead = x.shape();
  lead.pop_back();
  return {Tensor::from_values(x.shape(), y, DType::f64), Tensor::from_values(lead, m, DType::f64),
          Tensor::from_values(lead, r, DType::f64)};
}

TEST(OpsLayerNorm, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{65, 96}, Shape{2, 3, 33}}) {
      Tensor x = randn(s, dt, rng), w = randn({s.back()}, dt, rng), b = randn({s.back()}, dt, rng);
      // An offset mean, so the centring matters.
      Tensor xo = Tensor::from_values(s, x.to_f64_vector(), dt);
      {
        auto v = xo.to_f64_vector();
        for (auto& e : v) e += 3.0;
        xo = Tensor::from_values(s, v, dt);
      }
      auto out = ops::layernorm_forward(xo, w, b, 1e-5);
      auto ref = ref_layernorm(xo, w, b, 1e-5);
      EXPECT_TRUE(close(out.y, ref.y, tolerance_for(dt))) << dtype_name(dt) << shape_str(s);
      EXPECT_TRUE(close(out.mean, ref.mean, tolerance_for(dt)));
      EXPECT_TRUE(close(out.rstd, ref.rstd, tolerance_for(dt)));
    }
}

TEST(OpsLayerNorm, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  for (Shape s : {Shape{1, 2}, Shape{5, 7}, Shape{2, 3, 10}}) {
    Tensor x = randn(s, DType::f64, rng), w = randn({s.back()}, DType::f64, rng);
    Tensor b = randn({s.back()}, DType::f64, rng), probe = randn(s, DType::f64, rng);
    auto loss = [&] { return dot(ops::layernorm_forward(x, w, b).y, probe); };
    auto out = ops::layernorm_forward(x, w, b);
    Tensor dw0 = randn({s.back()}, DType::f64, rng), db0 = randn({s.back()}, DType::f64, rng);
    Tensor dw = dw0.clone(), db = db0.clone();
    Tensor dx = ops::layernorm_backward(probe, x, w, out.mean, out.rstd, dw, db);
    EXPECT_TRUE(grad_check(loss, x, dx)) << shape_str(s);
    EXPECT_TRUE(grad_check(loss, w, minus(dw, dw0))) << shape_str(s);
    EXPECT_TRUE(grad_check(loss, b, minus(db, db0))) << shape_str(s);
  }
}

TEST(OpsLayerNorm, BadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({3, 4}, DType::f32, rng), w = randn({4}, DType::f32, rng);
  EXPECT_THROW(ops::layernorm_forward(x, w, randn({5}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::layernorm_forward(x, w.to(DType::f64), w), Error);
  auto out = ops::layernorm_forward(x, w, w);
  Tensor dw = Tensor::zeros({4}, DType::f32), db = Tensor::zeros({3}, DType::f32);
  EXPECT_THROW(ops::layernorm_backward(x, x, w, out.mean, out.rstd, dw, db), Error);
}

}  // namespace
}  // namespace hlm
