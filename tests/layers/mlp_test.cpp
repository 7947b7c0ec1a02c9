// DenseMlp (layers/mlp.h) and the RmsNorm module (layers/norm.h): FP64 loop references written
// here, central finite differences of every parameter and input, recompute and packing bit for bit,
// the precision policy, bf16 parameters, and configuration errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "layers/mlp.h"
#include "layers/norm.h"
#include "testing.h"

namespace hlm {
namespace {

using hlm::testing::expect_error;

using testing::bit_equal;
using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;

double sigm(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

PrecisionPolicy native_policy() {
  PrecisionPolicy p;
  p.default_kind = GemmKind::native;
  return p;
}

DenseMlpConfig mlp_cfg(int64_t D, int64_t I, double limit, DType dt, uint64_t seed) {
  DenseMlpConfig c;
  c.hidden_size = D;
  c.intermediate_size = I;
  c.swiglu_limit = limit;
  c.dtype = dt;
  c.seed = seed;
  c.init_std = 0.5;
  return c;
}

// y = Wd (silu(min(Wg x, L)) * clamp(Wu x, -L, L)) in FP64 loops.
std::vector<double> ref_mlp(DenseMlp& m, const Tensor& x, double L) {
  const auto xv = x.to_f64_vector();
  const auto wg = m.gate_proj().weight().value.to_f64_vector();
  const auto wu = m.up_proj().weight().value.to_f64_vector();
  const auto wd = m.down_proj().weight().value.to_f64_vector();
  const int64_t T = x.size(0), D = x.size(1), I = m.config().intermediate_size;
  std::vector<double> y(size_t(T * D), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> h(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t d = 0; d < D; ++d) {
        g += wg[size_t(i * D + d)] * xv[size_t(t * D + d)];
        u += wu[size_t(i * D + d)] * xv[size_t(t * D + d)];
      }
      if (L > 0) g = std::min(g, L), u = std::clamp(u, -L, L);
      h[size_t(i)] = g * sigm(g) * u;
    }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < I; ++i) y[size_t(t * D + d)] += wd[size_t(d * I + i)] * h[size_t(i)];
  }
  return y;
}

// Central differences of every parameter of m and of x for loss(); grads from one backward.
void check_all_grads(Module& m, const std::function<double()>& loss, Tensor& x, const Tensor& dx,
                     double tol) {
  EXPECT_TRUE(grad_check(loss, x, dx, 1e-6, tol)) << "dx";
  for (auto& [name, p] : m.named_parameters()) {
    const Tensor g = p->grad.clone();
    EXPECT_TRUE(grad_check(loss, p->value, g, 1e-6, tol, 48)) << name;
  }
}

void copy_params(Module& from, Module& to) {
  for (auto& [name, p] : from.named_parameters()) {
    Param* q = to.find_parameter(name);
    ASSERT_NE(q, nullptr) << name;
    q->value.copy_(p->value);
  }
}

// ---- DenseMlp
// -------------------------------------------------------------------------------------

TEST(DenseMlp, ParametersNamesShapesAndInit) {
  DenseMlp m(mlp_cfg(6, 5, 10.0, DType::f32, 7), native_policy(), "model.layers.0.mlp");
  const auto params = m.named_parameters();
  ASSERT_EQ(params.size(), 3u);
  EXPECT_EQ(params[0].first, "gate_proj.weight");
  EXPECT_EQ(params[1].first, "up_proj.weight");
  EXPECT_EQ(params[2].first, "down_proj.weight");
  EXPECT_EQ(params[0].second->value.shape(), Shape({5, 6}));
  EXPECT_EQ(params[2].second->value.shape(), Shape({6, 5}));
  for (auto& [n, p] : params) EXPECT_FALSE(p->keep_fp32 || p->no_weight_decay) << n;
  // deterministic from the seed; the three weights and other paths get different streams
  DenseMlp a(mlp_cfg(6, 5, 10.0, DType::f32, 7), native_policy(), "model.layers.0.mlp");
  DenseMlp b(mlp_cfg(6, 5, 10.0, DType::f32, 8), native_policy(), "model.layers.0.mlp");
  DenseMlp c(mlp_cfg(6, 5, 10.0, DType::f32, 7), native_policy(), "model.layers.1.mlp");
  EXPECT_TRUE(bit_equal(a.gate_proj().weight().value, m.gate_proj().weight().value));
  EXPECT_FALSE(bit_equal(b.gate_proj().weight().value, m.gate_proj().weight().value));
  EXPECT_FALSE(bit_equal(c.gate_proj().weight().value, m.gate_proj().weight().value));
  EXPECT_FALSE(bit_equal(m.up_proj().weight().value, m.gate_proj().weight().value));
  // N(0, init_std): sample standard deviation of a larger weight
  DenseMlpConfig big = mlp_cfg(64, 96, 10.0, DType::f32, 3);
  big.init_std = 0.02;
  DenseMlp l(big, native_policy(), "m");
  const auto v = l.gate_proj().weight().value.to_f64_vector();
  double ss = 0, mean = 0;
  for (double e : v) mean += e / double(v.size());
  for (double e : v) ss += (e - mean) * (e - mean) / double(v.size());
  EXPECT_NEAR(std::sqrt(ss), 0.02, 0.002);
  EXPECT_NEAR(mean, 0.0, 0.002);
}

TEST(DenseMlp, ForwardMatchesReferenceWithClamp) {
  for (double L : {0.7, 0.0}) {
    DenseMlp m(mlp_cfg(7, 9, L, DType::f64, test_seed()), native_policy(), "mlp");
    Rng rng(test_seed());
    const Tensor x = randn({11, 7}, DType::f64, rng);
    const Tensor y = m.forward(Context{}, x, nullptr);
    ASSERT_EQ(y.dtype(), DType::f64);
    EXPECT_TRUE(close(y, Tensor::from_values({11, 7}, ref_mlp(m, x, L), DType::f64),
                      testing::tolerance_for(DType::f64)))
        << "limit " << L;
  }
  // the clamp is really active at L = 0.7 (else the test above would not exercise it)
  DenseMlp m(mlp_cfg(7, 9, 0.7, DType::f64, test_seed()), native_policy(), "mlp");
  Rng rng(test_seed());
  const Tensor x = randn({11, 7}, DType::f64, rng);
  EXPECT_FALSE(close(m.forward(Context{}, x, nullptr),
                     Tensor::from_values({11, 7}, ref_mlp(m, x, 0.0), DType::f64), {1e-3, 1e-3}));
}

TEST(DenseMlp, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  DenseMlp m(mlp_cfg(5, 6, 0.9, DType::f64, test_seed()), native_policy(), "mlp");
  Tensor x = randn({7, 5}, DType::f64, rng);
  const Tensor G = randn({7, 5}, DType::f64, rng);
  auto loss = [&] { return dot(m.forward(Context{}, x, nullptr), G); };
  DenseMlp::Saved s;
  m.forward(Context{}, x, &s);
  m.zero_grad();
  const Tensor dx = m.backward(Context{}, G, s);
  ASSERT_EQ(dx.dtype(), DType::f64);
  check_all_grads(m, loss, x, dx, 1e-6);
  // parameter gradients accumulate (+=)
  const Tensor g1 = m.down_proj().weight().grad.clone();
  m.backward(Context{}, G, s);
  const auto a = m.down_proj().weight().grad.to_f64_vector(), b = g1.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], 2 * b[i], 1e-13 * (1 + std::fabs(b[i])));
}

TEST(DenseMlp, RecomputeIsBitIdentical) {
  Rng rng(test_seed());
  for (GemmKind k : {GemmKind::native, GemmKind::fp8_block}) {
    PrecisionPolicy pol;
    pol.default_kind = k;
    DenseMlp m(mlp_cfg(130, 40, 1.0, DType::f32, test_seed()), pol, "mlp");
    const Tensor x = randn({9, 130}, DType::f32, rng), G = randn({9, 130}, DType::f32, rng);
    Tensor dx[2], gw[2], gd[2];
    for (int r = 0; r < 2; ++r) {
      const Context ctx{true, r == 1};
      DenseMlp::Saved s;
      m.forward(ctx, x, &s);
      EXPECT_EQ(s.recomputed, r == 1);
      EXPECT_EQ(s.gu.defined(), r == 0);
      m.zero_grad();
      dx[r] = m.backward(ctx, G, s);
      gw[r] = m.gate_proj().weight().grad.clone();
      gd[r] = m.down_proj().weight().grad.clone();
    }
    EXPECT_TRUE(bit_equal(dx[0], dx[1])) << gemm_kind_name(k);
    EXPECT_TRUE(bit_equal(gw[0], gw[1])) << gemm_kind_name(k);
    EXPECT_TRUE(bit_equal(gd[0], gd[1])) << gemm_kind_name(k);
  }
}

TEST(DenseMlp, PackedBatchEqualsSequencesBitwise) {
  Rng rng(test_seed());
  for (GemmKind k : {GemmKind::native, GemmKind::bf16, GemmKind::fp8_block}) {
    PrecisionPolicy pol;
    pol.default_kind = k;
    DenseMlp m(mlp_cfg(24, 20, 1.5, DType::f32, test_seed()), pol, "mlp");
    const std::vector<int64_t> lens{5, 1, 9};
    const Tensor x = randn({15, 24}, DType::f32, rng), G = randn({15, 24}, DType::f32, rng);
    DenseMlp::Saved s;
    const Tensor y = m.forward(Context{}, x, &s);
    const Tensor dx = m.backward(Context{}, G, s);
    int64_t t0 = 0;
    for (int64_t L : lens) {
      DenseMlp::Saved si;
      const Tensor yi = m.forward(Context{}, x.slice(0, t0, t0 + L).contiguous(), &si);
      const Tensor dxi = m.backward(Context{}, G.slice(0, t0, t0 + L).contiguous(), si);
      EXPECT_TRUE(bit_equal(yi, y.slice(0, t0, t0 + L).contiguous())) << gemm_kind_name(k);
      EXPECT_TRUE(bit_equal(dxi, dx.slice(0, t0, t0 + L).contiguous())) << gemm_kind_name(k);
      t0 += L;
    }
  }
}

TEST(DenseMlp, PrecisionComesFromThePolicy) {
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::fp8_block;
  pol.grad_format = Fp8Format::e5m2;
  pol.modules_to_not_convert = {"model.layers.1.mlp.down_proj"};
  DenseMlp m0(mlp_cfg(8, 8, 10, DType::f32, 1), pol, "model.layers.0.mlp");
  DenseMlp m1(mlp_cfg(8, 8, 10, DType::f32, 1), pol, "model.layers.1.mlp");
  EXPECT_EQ(m0.gate_proj().precision().kind, GemmKind::fp8_block);
  EXPECT_EQ(m0.gate_proj().precision().grad_format, Fp8Format::e5m2);
  EXPECT_EQ(m0.down_proj().precision().kind, GemmKind::fp8_block);
  EXPECT_EQ(m1.up_proj().precision().kind, GemmKind::fp8_block);
  EXPECT_EQ(m1.down_proj().precision().kind, GemmKind::bf16);
  pol.default_kind = GemmKind::bf16;
  DenseMlp b(mlp_cfg(8, 8, 10, DType::f32, 1), pol, "x");
  EXPECT_EQ(b.up_proj().precision().kind, GemmKind::bf16);
  // the fp8 module computes something FP8-close to, but not equal to, the native one
  Rng rng(test_seed());
  pol.default_kind = GemmKind::fp8_block;
  DenseMlp f(mlp_cfg(64, 48, 10, DType::f32, 5), pol, "mlp");
  DenseMlp n(mlp_cfg(64, 48, 10, DType::f32, 5), native_policy(), "mlp");
  const Tensor x = randn({6, 64}, DType::f32, rng);
  const Tensor yf = f.forward(Context{}, x, nullptr), yn = n.forward(Context{}, x, nullptr);
  EXPECT_FALSE(close(yf, yn, {1e-4, 1e-4}));
  EXPECT_TRUE(close(yf, yn, {0.1, 20.0}));  // |y| ~ 80 at init_std 0.5
}

TEST(DenseMlp, Bf16ParametersAreComputedInFp32) {
  Rng rng(test_seed());
  DenseMlp m(mlp_cfg(16, 12, 2.0, DType::f32, test_seed()), native_policy(), "mlp");
  m.to_dtype(DType::bf16);
  for (auto& [n, p] : m.named_parameters()) EXPECT_EQ(p->value.dtype(), DType::bf16) << n;
  // a twin holding the same (bf16) values in f32 gives bit-identical results
  DenseMlp t(mlp_cfg(16, 12, 2.0, DType::f32, 0), native_policy(), "mlp");
  copy_params(m, t);
  const Tensor x = randn({5, 16}, DType::f32, rng), G = randn({5, 16}, DType::f32, rng);
  DenseMlp::Saved sm, st;
  EXPECT_TRUE(bit_equal(m.forward(Context{}, x, &sm), t.forward(Context{}, x, &st)));
  m.zero_grad();
  t.zero_grad();
  EXPECT_TRUE(bit_equal(m.backward(Context{}, G, sm), t.backward(Context{}, G, st)));
  EXPECT_EQ(m.gate_proj().weight().grad.dtype(), DType::f32);
  EXPECT_TRUE(bit_equal(m.gate_proj().weight().grad, t.gate_proj().weight().grad));
  // bf16 activations: output and dx in bf16
  DenseMlp::Saved sb;
  const Tensor yb = m.forward(Context{}, x.to(DType::bf16), &sb);
  EXPECT_EQ(yb.dtype(), DType::bf16);
  EXPECT_EQ(m.backward(Context{}, G, sb).dtype(), DType::bf16);
}

TEST(DenseMlp, BadConfigAndInputsThrow) {
  const PrecisionPolicy pol = native_policy();
  auto make = [&](const DenseMlpConfig& c) { DenseMlp m(c, pol, "mlp"); };
  DenseMlpConfig c = mlp_cfg(8, 8, 10, DType::f32, 0);
  c.hidden_size = 0;
  expect_error([&] { make(c); }, "hidden_size");
  c = mlp_cfg(8, 0, 10, DType::f32, 0);
  expect_error([&] { make(c); }, "intermediate_size");
  c = mlp_cfg(8, 8, std::nan(""), DType::f32, 0);
  expect_error([&] { make(c); }, "swiglu_limit");
  c = mlp_cfg(8, 8, 10, DType::i64, 0);
  expect_error([&] { make(c); }, "dtype");
  c = mlp_cfg(8, 8, 10, DType::f32, 0);
  c.init_std = -1;
  expect_error([&] { make(c); }, "init_std");
  // inputs
  DenseMlp m(mlp_cfg(8, 8, 10, DType::f32, 0), pol, "mlp");
  Rng rng(test_seed());
  expect_error([&] { m.forward(Context{}, randn({3, 7}, DType::f32, rng), nullptr); }, "[T, 8]");
  expect_error([&] { m.forward(Context{}, Tensor::zeros({3, 8}, DType::i32), nullptr); }, "f64");
  DenseMlp::Saved empty;
  expect_error([&] { m.backward(Context{}, randn({3, 8}, DType::f32, rng), empty); }, "Saved");
  DenseMlp::Saved s;
  m.forward(Context{}, randn({3, 8}, DType::f32, rng), &s);
  expect_error([&] { m.backward(Context{}, randn({4, 8}, DType::f32, rng), s); }, "dy");
  // inference does not fill Saved
  DenseMlp::Saved si;
  m.forward(Context{false, false}, randn({3, 8}, DType::f32, rng), &si);
  EXPECT_FALSE(si.x.defined());
}

// ---- RmsNorm ------------------------------------------------------------------------------------

RmsNormConfig norm_cfg(int64_t D, DType dt) {
  RmsNormConfig c;
  c.dim = D;
  c.dtype = dt;
  return c;
}

TEST(RmsNormModule, ForwardAndGradientsMatchReference) {
  Rng rng(test_seed());
  RmsNorm n(norm_cfg(6, DType::f64), "model.norm");
  ASSERT_EQ(n.named_parameters().size(), 1u);
  EXPECT_EQ(n.named_parameters()[0].first, "weight");
  EXPECT_TRUE(n.weight().no_weight_decay);
  EXPECT_TRUE(bit_equal(n.weight().value, Tensor::full({6}, 1.0, DType::f64)));
  rng.fill_normal(n.weight().value, 1.0, 0.3);
  Tensor x = randn({4, 3, 6}, DType::f64, rng);  // [..., D]
  const Tensor y = n.forward(Context{}, x, nullptr);
  const auto xv = x.to_f64_vector(), wv = n.weight().value.to_f64_vector();
  std::vector<double> ref(xv.size());
  for (size_t r = 0; r < 12; ++r) {
    double ss = 0;
    for (size_t i = 0; i < 6; ++i) ss += xv[r * 6 + i] * xv[r * 6 + i];
    const double rs = 1.0 / std::sqrt(ss / 6 + 1e-5);
    for (size_t i = 0; i < 6; ++i) ref[r * 6 + i] = xv[r * 6 + i] * rs * wv[i];
  }
  EXPECT_TRUE(close(y, Tensor::from_values(x.shape(), ref, DType::f64),
                    testing::tolerance_for(DType::f64)));
  const Tensor G = randn(x.shape(), DType::f64, rng);
  auto loss = [&] { return dot(n.forward(Context{}, x, nullptr), G); };
  RmsNorm::Saved s;
  n.forward(Context{}, x, &s);
  n.zero_grad();
  const Tensor dx = n.backward(Context{}, G, s);
  check_all_grads(n, loss, x, dx, 1e-7);
  const Tensor g1 = n.weight().grad.clone();
  n.backward(Context{}, G, s);  // +=
  const auto a = n.weight().grad.to_f64_vector(), b = g1.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], 2 * b[i], 1e-13 * (1 + std::fabs(b[i])));
}

TEST(RmsNormModule, RecomputePackingAndBf16) {
  Rng rng(test_seed());
  RmsNorm n(norm_cfg(32, DType::f32), "n");
  rng.fill_normal(n.weight().value, 1.0, 0.2);
  const Tensor x = randn({10, 32}, DType::f32, rng), G = randn({10, 32}, DType::f32, rng);
  Tensor dx[2], dw[2];
  for (int r = 0; r < 2; ++r) {
    RmsNorm::Saved s;
    n.forward(Context{true, r == 1}, x, &s);
    EXPECT_EQ(s.rstd.defined(), r == 0);
    n.zero_grad();
    dx[r] = n.backward(Context{true, r == 1}, G, s);
    dw[r] = n.weight().grad.clone();
  }
  EXPECT_TRUE(bit_equal(dx[0], dx[1]));
  EXPECT_TRUE(bit_equal(dw[0], dw[1]));
  // packed == one by one
  const Tensor y = n.forward(Context{}, x, nullptr);
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 3}, {3, 4}, {4, 10}}) {
    RmsNorm::Saved s;
    const Tensor xi = x.slice(0, a, b).contiguous();
    EXPECT_TRUE(bit_equal(n.forward(Context{}, xi, &s), y.slice(0, a, b).contiguous()));
    EXPECT_TRUE(bit_equal(n.backward(Context{}, G.slice(0, a, b).contiguous(), s),
                          dx[0].slice(0, a, b).contiguous()));
  }
  // bf16 weight computed in f32: the same as an f32 weight holding the bf16 values
  RmsNorm t(norm_cfg(32, DType::f32), "t");
  n.to_dtype(DType::bf16);
  EXPECT_EQ(n.weight().value.dtype(), DType::bf16);
  t.weight().value.copy_(n.weight().value);
  EXPECT_TRUE(bit_equal(n.forward(Context{}, x, nullptr), t.forward(Context{}, x, nullptr)));
  RmsNorm::Saved sb;
  const Tensor yb = n.forward(Context{}, x.to(DType::bf16), &sb);
  EXPECT_EQ(yb.dtype(), DType::bf16);
  EXPECT_TRUE(close(yb, t.forward(Context{}, x.to(DType::bf16), nullptr),
                    testing::tolerance_for(DType::bf16)));
  n.zero_grad();
  EXPECT_EQ(n.backward(Context{}, G, sb).dtype(), DType::bf16);
  EXPECT_EQ(n.weight().grad.dtype(), DType::f32);
}

TEST(RmsNormModule, BadConfigAndInputsThrow) {
  expect_error([] { RmsNorm n(norm_cfg(0, DType::f32), "n"); }, "dim");
  RmsNormConfig c = norm_cfg(4, DType::f32);
  c.eps = -1;
  expect_error([&] { RmsNorm n(c, "n"); }, "eps");
  expect_error([] { RmsNorm n(norm_cfg(4, DType::e4m3), "n"); }, "dtype");
  RmsNorm n(norm_cfg(4, DType::f32), "model.norm");
  Rng rng(test_seed());
  expect_error([&] { n.forward(Context{}, randn({2, 5}, DType::f32, rng), nullptr); }, "[..., 4]");
  RmsNorm::Saved s;
  expect_error([&] { n.backward(Context{}, randn({2, 4}, DType::f32, rng), s); }, "Saved");
  n.forward(Context{}, randn({2, 4}, DType::f32, rng), &s);
  expect_error([&] { n.backward(Context{}, randn({3, 4}, DType::f32, rng), s); }, "dy");
}

}  // namespace
}  // namespace hlm
