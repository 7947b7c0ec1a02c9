// Tests of the KDA decay gate: values, gradients vs finite differences (f64), saturation without
// NaN, determinism and argument checks.
#include <cmath>

#include "ops/kda_gate.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::KdaGateArgs;
using ops::KdaGateKind;

KdaGateArgs make_gate(Rng& rng, KdaGateKind kind, DType dt, int64_t T = 7, int64_t HV = 3,
                      int64_t K = 5) {
  KdaGateArgs a;
  a.kind = kind;
  a.z = randn({T, HV, K}, dt, rng, 2.0);
  a.A_log = rand_uniform({HV}, dt, rng, -1, 1);
  a.dt_bias = rand_uniform({HV * K}, dt, rng, -1, 1);
  a.lower_bound = -5;
  return a;
}

TEST(KdaGate, Values) {
  Rng rng(testing::test_seed());
  for (auto kind : {KdaGateKind::standard, KdaGateKind::lower_bound}) {
    KdaGateArgs a = make_gate(rng, kind, DType::f64);
    a.lower_bound = -3;
    Tensor g = ops::kda_gate(a);
    const auto z = a.z.to_f64_vector(), A = a.A_log.to_f64_vector(), b = a.dt_bias.to_f64_vector();
    const auto gv = g.to_f64_vector();
    for (int64_t i = 0; i < g.numel(); ++i) {
      const int64_t c = i % 5, h = (i / 5) % 3;
      const double x = z[size_t(i)] + b[size_t(h * 5 + c)];
      const double ref = kind == KdaGateKind::standard
                             ? -std::exp(A[size_t(h)]) * std::log1p(std::exp(x))
                             : -3.0 / (1.0 + std::exp(-std::exp(A[size_t(h)]) * x));
      EXPECT_NEAR(gv[size_t(i)], ref, 1e-13 * (1 + std::fabs(ref)));
      if (kind == KdaGateKind::lower_bound) EXPECT_TRUE(gv[size_t(i)] > -3 && gv[size_t(i)] < 0);
    }
  }
}

void gate_grad_check(KdaGateKind kind, bool with_A) {
  Rng rng(testing::test_seed());
  KdaGateArgs a = make_gate(rng, kind, DType::f64);
  if (!with_A) a.A_log = Tensor();
  Tensor w = randn({7, 3, 5}, DType::f64, rng);
  auto loss = [&]() { return testing::dot(ops::kda_gate(a), w); };
  auto g = ops::kda_gate_backward(a, w);
  EXPECT_TRUE(testing::grad_check(loss, a.z, g.dz, 1e-6, 1e-7)) << "dz";
  EXPECT_TRUE(testing::grad_check(loss, a.dt_bias, g.ddt_bias, 1e-6, 1e-7)) << "ddt_bias";
  if (with_A)
    EXPECT_TRUE(testing::grad_check(loss, a.A_log, g.dA_log, 1e-6, 1e-7)) << "dA_log";
  else
    EXPECT_FALSE(g.dA_log.defined());
}

TEST(KdaGate, StandardGradCheck) {
  gate_grad_check(KdaGateKind::standard, true);
}
TEST(KdaGate, LowerBoundGradCheck) {
  gate_grad_check(KdaGateKind::lower_bound, true);
}
TEST(KdaGate, LowerBoundNoALogGradCheck) {
  gate_grad_check(KdaGateKind::lower_bound, false);
}

// f32 forward/backward against the f64 computation.
TEST(KdaGate, F32MatchesF64) {
  Rng rng(testing::test_seed());
  for (auto kind : {KdaGateKind::standard, KdaGateKind::lower_bound}) {
    KdaGateArgs a = make_gate(rng, kind, DType::f32, 50, 4, 16);
    KdaGateArgs a64 = a;
    a64.z = a.z.to(DType::f64);
    a64.A_log = a.A_log.to(DType::f64);
    a64.dt_bias = a.dt_bias.to(DType::f64);
    Tensor dy = randn({50, 4, 16}, DType::f32, rng);
    EXPECT_EQ(ops::kda_gate(a).dtype(), DType::f32);
    EXPECT_TRUE(
        testing::close(ops::kda_gate(a), ops::kda_gate(a64), testing::tolerance_for(DType::f32)));
    auto g = ops::kda_gate_backward(a, dy), g64 = ops::kda_gate_backward(a64, dy);
    EXPECT_TRUE(testing::close(g.dz, g64.dz, {1e-5, 1e-4}));
    EXPECT_TRUE(testing::close(g.dA_log, g64.dA_log, {1e-5, 1e-3}));
    EXPECT_TRUE(testing::close(g.ddt_bias, g64.ddt_bias, {1e-5, 1e-4}));
  }
}

// exp(A_log) overflows f32 (A_log = 100) and the sigmoid saturates: no NaN anywhere.
TEST(KdaGate, SaturationNoNaN) {
  for (auto kind : {KdaGateKind::standard, KdaGateKind::lower_bound}) {
    KdaGateArgs a;
    a.kind = kind;
    a.z = Tensor::from_values({1, 2, 4}, {0, 1e30, -1e30, -200, 0, 50, -50, 1e-40}, DType::f32);
    a.A_log = Tensor::from_values({2}, {100, -100}, DType::f32);
    a.dt_bias = Tensor::zeros({8}, DType::f32);
    Tensor g = ops::kda_gate(a);
    for (double x : g.to_f64_vector()) EXPECT_FALSE(std::isnan(x)) << int(kind);
    if (kind == KdaGateKind::lower_bound)
      for (double x : g.to_f64_vector()) EXPECT_TRUE(x >= -5 && x <= 0);
    auto gr = ops::kda_gate_backward(a, Tensor::full({1, 2, 4}, 1.0, DType::f32));
    for (const Tensor* t : {&gr.dz, &gr.dA_log, &gr.ddt_bias})
      for (double x : t->to_f64_vector()) EXPECT_FALSE(std::isnan(x)) << int(kind);
  }
}

TEST(KdaGate, Deterministic) {
  Rng rng(testing::test_seed());
  KdaGateArgs a = make_gate(rng, KdaGateKind::lower_bound, DType::f32, 3000, 4, 32);
  Tensor dy = randn({3000, 4, 32}, DType::f32, rng);
  auto g1 = ops::kda_gate_backward(a, dy), g2 = ops::kda_gate_backward(a, dy);
  EXPECT_TRUE(testing::bit_equal(g1.dA_log, g2.dA_log));
  EXPECT_TRUE(testing::bit_equal(g1.ddt_bias, g2.ddt_bias));
  EXPECT_TRUE(testing::bit_equal(g1.dz, g2.dz));
}

TEST(KdaGate, BadInputs) {
  Rng rng(testing::test_seed());
  KdaGateArgs a = make_gate(rng, KdaGateKind::lower_bound, DType::f32);
  for (double lb : {-5.5, 0.0, 0.5}) {
    KdaGateArgs b = a;
    b.lower_bound = lb;
    EXPECT_THROW(ops::kda_gate(b), Error) << lb;
    EXPECT_THROW(ops::kda_gate_backward(b, a.z), Error) << lb;
  }
  a.lower_bound = -5;
  EXPECT_NO_THROW(ops::kda_gate(a));
  KdaGateArgs b = a;
  b.A_log = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(ops::kda_gate(b), Error);
  b = a;
  b.dt_bias = Tensor::zeros({3, 5}, DType::f32);
  EXPECT_THROW(ops::kda_gate(b), Error);
  b = a;
  b.kind = KdaGateKind::standard;
  b.A_log = Tensor();
  EXPECT_THROW(ops::kda_gate(b), Error);
  b = a;
  b.z = Tensor::zeros({7, 15}, DType::f32);
  EXPECT_THROW(ops::kda_gate(b), Error);
  EXPECT_THROW(ops::kda_gate_backward(a, Tensor::zeros({7, 3, 4}, DType::f32)), Error);
}

// The one range check of the lower bound: [-5, 0), finite; every caller names itself.
TEST(KdaGate, LowerBoundRange) {
  EXPECT_NO_THROW(ops::check_kda_lower_bound(-5.0, "w"));
  EXPECT_NO_THROW(ops::check_kda_lower_bound(-1e-300, "w"));
  for (double bad : {-5.000001, 0.0, 1.0, std::nan(""), -double(INFINITY)}) {
    testing::expect_error([&] { ops::check_kda_lower_bound(bad, "KdaConfig", "lower_bound"); },
                          "KdaConfig: lower_bound must lie in [-5, 0)");
  }
  KdaGateArgs a;
  a.z = Tensor::full({2, 1, 4}, 0.5, DType::f64);
  a.lower_bound = -6;
  testing::expect_error([&] { ops::kda_gate(a); }, "lower_bound must lie in [-5, 0), got -6");
}

}  // namespace
}  // namespace hlm
