// ops::sigmoid/silu/softplus forward and backward: FP64 references, no NaN/Inf for large |x|,
// softplus stable at both ends, gradients against central finite differences, bad input.
#include <cmath>

#include "ops/activations.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

// Plain FP64 formulas (long double inside to be independent of the op's branches).
double ref_sigmoid(double x) {
  return double(1.0L / (1.0L + std::exp(-(long double)x)));
}
double ref_softplus(double x) {
  return double(std::log1p(std::exp((long double)x)));
}

Tensor map(const Tensor& x, double (*f)(double)) {
  auto v = x.to_f64_vector();
  for (auto& e : v) e = f(e);
  return Tensor::from_values(x.shape(), v, DType::f64);
}

struct Act {
  const char* name;
  Tensor (*fwd)(const Tensor&);
  Tensor (*bwd)(const Tensor&, const Tensor&);
  double (*ref)(double);
  double (*ref_grad)(double);
};

const Act kActs[] = {
    {"sigmoid", ops::sigmoid_forward, ops::sigmoid_backward, ref_sigmoid,
     [](double x) { return ref_sigmoid(x) * (1 - ref_sigmoid(x)); }},
    {"silu", ops::silu_forward, ops::silu_backward, [](double x) { return x * ref_sigmoid(x); },
     [](double x) { return ref_sigmoid(x) + x * ref_sigmoid(x) * (1 - ref_sigmoid(x)); }},
    {"softplus", ops::softplus_forward, ops::softplus_backward, ref_softplus, ref_sigmoid},
};

TEST(OpsActivations, ForwardBackwardMatchFp64Reference) {
  Rng rng(test_seed());
  for (const Act& a : kActs)
    for (DType dt : {DType::f32, DType::f64})
      for (Shape s : {Shape{1}, Shape{7, 13}, Shape{3, 5, 65}}) {
        Tensor x = randn(s, dt, rng, 4.0), dy = randn(s, dt, rng);
        EXPECT_TRUE(close(a.fwd(x), map(x, a.ref), tolerance_for(dt))) << a.name << dtype_name(dt);
        auto vg = map(x, a.ref_grad).to_f64_vector(), vdy = dy.to_f64_vector();
        for (size_t i = 0; i < vg.size(); ++i) vg[i] *= vdy[i];
        EXPECT_TRUE(close(a.bwd(x, dy), Tensor::from_values(s, vg, DType::f64), tolerance_for(dt)))
            << a.name << dtype_name(dt);
      }
}

TEST(OpsActivations, LargeInputsStayFinite) {
  const std::vector<double> big = {-1e30, -1000, -100, -88.8, -30, 30, 88.8, 100, 1000, 1e30};
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor x = Tensor::from_values({int64_t(big.size())}, big, dt);
    Tensor dy = Tensor::full({int64_t(big.size())}, 1.0, dt);
    for (const Act& a : kActs) {
      for (const Tensor& t : {a.fwd(x), a.bwd(x, dy)})
        for (double v : t.to_f64_vector()) EXPECT_TRUE(std::isfinite(v)) << a.name << " " << v;
    }
    // Known limits: sigmoid(-1000) = 0, sigmoid(1000) = 1, softplus(1000) = 1000, softplus(-1000) ~
    // 0.
    auto s = ops::sigmoid_forward(x).to_f64_vector();
    EXPECT_EQ(s[1], 0.0);
    EXPECT_EQ(s[8], 1.0);
    auto sp = ops::softplus_forward(x).to_f64_vector();
    EXPECT_EQ(sp[8], 1000.0);
    EXPECT_GE(sp[1], 0.0);
    EXPECT_LT(sp[1], 1e-300);
    // softplus(30) keeps its small correction in f64: 30 + log1p(e^-30).
    if (dt == DType::f64) EXPECT_DOUBLE_EQ(sp[5], 30.0 + std::log1p(std::exp(-30.0)));
  }
}

TEST(OpsActivations, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  for (const Act& a : kActs) {
    Tensor x = randn({4, 9}, DType::f64, rng, 3.0), probe = randn({4, 9}, DType::f64, rng);
    auto loss = [&] { return dot(a.fwd(x), probe); };
    EXPECT_TRUE(grad_check(loss, x, a.bwd(x, probe))) << a.name;
  }
}

TEST(OpsActivations, StridedInputAndBadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({6, 5}, DType::f32, rng);
  Tensor xt = x.transpose(0, 1);
  EXPECT_TRUE(close(ops::silu_forward(xt), ops::silu_forward(xt.contiguous()), {0, 0}));
  EXPECT_THROW(ops::silu_forward(Tensor::zeros({3}, DType::i32)), Error);
  EXPECT_THROW(ops::sigmoid_backward(x, randn({6, 4}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::softplus_backward(x, x.to(DType::f64)), Error);
  EXPECT_THROW(ops::softplus_forward(Tensor()), Error);
}

}  // namespace
}  // namespace hlm
