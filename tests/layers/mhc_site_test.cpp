// MhcSite (layers/mhc/mhc_site.h): parameter names and keep-in-FP32, bit-identity with the
// ops/mhc.h site, central finite differences through a whole decoder-site chain
// (X -> collapse -> RmsNorm -> Linear -> tanh -> write_back), recompute, packing, init schemes,
// bf16 streams and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "layers/linear.h"
#include "layers/mhc/mhc_site.h"
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

MhcSiteConfig site_cfg(int64_t D, DType dt, uint64_t seed, double init_std = 0.3) {
  MhcSiteConfig c;
  c.hidden_size = D;
  c.dtype = dt;
  c.seed = seed;
  c.init_std = init_std;
  return c;
}

// Random base and scale too (the HF init has base 0 and scale 1, which would hide index bugs).
void randomize(MhcSite& s, Rng& rng) {
  rng.fill_normal(s.base().value, 0.0, 0.5);
  Tensor sc = rand_uniform({3}, DType::f64, rng, 0.5, 1.5);
  s.scale().value.copy_(sc);
}

TEST(MhcSiteModule, ParameterNamesShapesAndKeepFp32) {
  const PrecisionPolicy pol;  // bf16 default: mHC still native
  MhcSite a(site_cfg(8, DType::f32, 1), MhcSiteKind::attn, pol, "model.layers.3");
  MhcSite f(site_cfg(8, DType::f32, 1), MhcSiteKind::ffn, pol, "model.layers.3");
  const auto pa = a.named_parameters(), pf = f.named_parameters();
  ASSERT_EQ(pa.size(), 3u);
  EXPECT_EQ(pa[0].first, "hc_attn_fn");
  EXPECT_EQ(pa[1].first, "hc_attn_base");
  EXPECT_EQ(pa[2].first, "hc_attn_scale");
  EXPECT_EQ(pf[0].first, "hc_ffn_fn");
  EXPECT_EQ(pa[0].second->value.shape(), Shape({24, 32}));
  EXPECT_EQ(pa[1].second->value.shape(), Shape({24}));
  EXPECT_EQ(pa[2].second->value.shape(), Shape({3}));
  for (auto& [n, p] : pa) {
    EXPECT_TRUE(p->keep_fp32 && p->no_weight_decay) << n;
    EXPECT_TRUE(is_keep_fp32_name("model.layers.3." + n)) << n;
    EXPECT_EQ(p->value.dtype(), DType::f32) << n;
  }
  a.to_dtype(DType::bf16);
  for (auto& [n, p] : a.named_parameters()) EXPECT_EQ(p->value.dtype(), DType::f32) << n;
  a.to_dtype(DType::f64);
  for (auto& [n, p] : a.named_parameters()) EXPECT_EQ(p->value.dtype(), DType::f64) << n;
  // bf16 requested at construction: stored as f32
  MhcSite b(site_cfg(8, DType::bf16, 1), MhcSiteKind::attn, pol, "model.layers.3");
  EXPECT_EQ(b.fn().value.dtype(), DType::f32);
}

TEST(MhcSiteModule, InitSchemesAreDeterministicAndDocumented) {
  const PrecisionPolicy pol;
  MhcSiteConfig c = site_cfg(64, DType::f64, 11, 0.02);
  MhcSite a(c, MhcSiteKind::attn, pol, "model.layers.0");
  MhcSite a2(c, MhcSiteKind::attn, pol, "model.layers.0");
  MhcSite f(c, MhcSiteKind::ffn, pol, "model.layers.0");
  MhcSite l1(c, MhcSiteKind::attn, pol, "model.layers.1");
  EXPECT_TRUE(bit_equal(a.fn().value, a2.fn().value));
  EXPECT_FALSE(bit_equal(a.fn().value, f.fn().value));
  EXPECT_FALSE(bit_equal(a.fn().value, l1.fn().value));
  // HF: fn ~ N(0, 0.02), base 0, scale 1
  const auto v = a.fn().value.to_f64_vector();
  double ss = 0;
  for (double e : v) ss += e * e / double(v.size());
  EXPECT_NEAR(std::sqrt(ss), 0.02, 0.001);
  EXPECT_TRUE(bit_equal(a.base().value, Tensor::zeros({24}, DType::f64)));
  EXPECT_TRUE(bit_equal(a.scale().value, Tensor::full({3}, 1.0, DType::f64)));
  // residual: with fn = 0, pre = 1/n, post = 1, comb = I up to 1e-3 -> X'_i = X_i + y
  c.init = MhcInit::residual;
  MhcSite r(c, MhcSiteKind::attn, pol, "model.layers.0");
  EXPECT_TRUE(bit_equal(r.scale().value, Tensor::full({3}, 0.01, DType::f64)));
  r.fn().value.zero_();
  Rng rng(test_seed());
  const Tensor x = randn({3, 4, 64}, DType::f64, rng), y = randn({3, 64}, DType::f64, rng);
  MhcSite::Saved s;
  const Tensor u = r.collapse(Context{}, x, s);
  for (double p : s.maps.pre.to_f64_vector()) EXPECT_NEAR(p, 0.25, 1e-14);
  for (double p : s.maps.post.to_f64_vector()) EXPECT_NEAR(p, 1.0, 1e-14);
  const auto comb = s.maps.comb.to_f64_vector();
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 4; ++j)
        EXPECT_NEAR(comb[size_t(t * 16 + i * 4 + j)], i == j ? 1.0 : 0.0, 1.1e-3);
  EXPECT_TRUE(close(u, ops::mhc_mean_contract(x), {1e-13, 1e-13}));
  const Tensor xo = r.write_back(Context{}, y, s);
  const auto xv = x.to_f64_vector(), yv = y.to_f64_vector();
  std::vector<double> ref(xv.size());
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t d = 0; d < 64; ++d)
        ref[size_t((t * 4 + i) * 64 + d)] =
            xv[size_t((t * 4 + i) * 64 + d)] + yv[size_t(t * 64 + d)];
  EXPECT_TRUE(close(xo, Tensor::from_values({3, 4, 64}, ref, DType::f64), {5e-3, 2e-2}));
}

TEST(MhcSiteModule, MatchesOpsSiteBitwise) {
  Rng rng(test_seed());
  MhcSite site(site_cfg(24, DType::f32, test_seed(), 0.05), MhcSiteKind::ffn, PrecisionPolicy{},
               "model.layers.2");
  randomize(site, rng);
  const int64_t T = 7, D = 24;
  const Tensor x = randn({T, 4, D}, DType::f32, rng), y = randn({T, D}, DType::f32, rng);
  const Tensor G = randn({T, 4, D}, DType::f32, rng), du = randn({T, D}, DType::f32, rng);
  ops::MhcSiteSaved sv;
  const Tensor u_ref = ops::mhc_site_begin(x, site.params(), site.config().op_config(), sv);
  const Tensor xo_ref = ops::mhc_site_end(sv, y);
  const Tensor dy_ref = ops::mhc_site_backward_dy(sv, G);
  ops::MhcParamGrads g{Tensor::zeros({24, 4 * D}, DType::f32), Tensor::zeros({24}, DType::f32),
                       Tensor::zeros({3}, DType::f32)};
  const Tensor dx_ref = ops::mhc_site_backward(sv, G, du, g);

  MhcSite::Saved s;
  site.zero_grad();
  EXPECT_TRUE(bit_equal(site.collapse(Context{}, x, s), u_ref));
  EXPECT_TRUE(bit_equal(site.write_back(Context{}, y, s), xo_ref));
  const MhcSite::Partial p = site.backward_write_back(Context{}, G, s);
  EXPECT_TRUE(bit_equal(p.dy, dy_ref));
  EXPECT_TRUE(bit_equal(site.backward_collapse(Context{}, du, s, p), dx_ref));
  EXPECT_TRUE(bit_equal(site.fn().grad, g.dfn));
  EXPECT_TRUE(bit_equal(site.base().grad, g.dbase));
  EXPECT_TRUE(bit_equal(site.scale().grad, g.dscale));
}

// The decoder-site chain X -> collapse -> RmsNorm -> Linear -> tanh -> write_back, all FP64.
struct Chain {
  MhcSite& site;
  RmsNorm& norm;
  Linear& lin;
  struct State {
    MhcSite::Saved s;
    RmsNorm::Saved ns;
    Linear::Saved ls;
    Tensor z;  // pre-tanh
  };
  Tensor forward(const Context& ctx, const Tensor& x, State& st) const {
    const Tensor u = site.collapse(ctx, x, st.s);
    st.z = lin.forward(ctx, norm.forward(ctx, u, &st.ns), &st.ls);
    std::vector<double> v = st.z.to_f64_vector();
    for (double& e : v) e = std::tanh(e);
    return site.write_back(ctx, Tensor::from_values(st.z.shape(), v, st.z.dtype()), st.s);
  }
  Tensor backward(const Context& ctx, const Tensor& g, State& st) {
    const MhcSite::Partial p = site.backward_write_back(ctx, g, st.s);
    std::vector<double> dz = p.dy.to_f64_vector();
    const std::vector<double> z = st.z.to_f64_vector();
    for (size_t i = 0; i < dz.size(); ++i) dz[i] *= 1.0 - std::tanh(z[i]) * std::tanh(z[i]);
    const Tensor dn = lin.backward(ctx, Tensor::from_values(st.z.shape(), dz, st.z.dtype()), st.ls);
    const Tensor du = norm.backward(ctx, dn, st.ns);
    return site.backward_collapse(ctx, du, st.s, p);
  }
};

TEST(MhcSiteModule, ChainGradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t T = 3, D = 5;
  MhcSite site(site_cfg(D, DType::f64, test_seed(), 0.4), MhcSiteKind::attn, PrecisionPolicy{},
               "model.layers.0");
  randomize(site, rng);
  RmsNormConfig nc;
  nc.dim = D;
  nc.dtype = DType::f64;
  RmsNorm norm(nc, "model.layers.0.input_layernorm");
  rng.fill_normal(norm.weight().value, 1.0, 0.3);
  Linear lin(D, D, false, GemmPrecision{GemmKind::native}, DType::f64);
  rng.fill_normal(lin.weight().value, 0.0, 0.6);
  Chain chain{site, norm, lin};
  Tensor x = randn({T, 4, D}, DType::f64, rng);
  const Tensor G = randn({T, 4, D}, DType::f64, rng);
  auto loss = [&] {
    Chain::State st;
    return dot(chain.forward(Context{false, false}, x, st), G);
  };
  Chain::State st;
  chain.forward(Context{}, x, st);
  site.zero_grad();
  norm.zero_grad();
  lin.zero_grad();
  const Tensor dx = chain.backward(Context{}, G, st);
  ASSERT_EQ(dx.dtype(), DType::f64);
  EXPECT_TRUE(grad_check(loss, x, dx, 1e-6, 1e-6)) << "dX";
  EXPECT_TRUE(grad_check(loss, site.fn().value, site.fn().grad.clone(), 1e-6, 1e-6, 120))
      << "hc_attn_fn";
  EXPECT_TRUE(grad_check(loss, site.base().value, site.base().grad.clone(), 1e-6, 1e-6, 24))
      << "hc_attn_base";
  EXPECT_TRUE(grad_check(loss, site.scale().value, site.scale().grad.clone(), 1e-6, 1e-6, 3))
      << "hc_attn_scale";
  EXPECT_TRUE(grad_check(loss, norm.weight().value, norm.weight().grad.clone(), 1e-6, 1e-6))
      << "norm weight";
  EXPECT_TRUE(grad_check(loss, lin.weight().value, lin.weight().grad.clone(), 1e-6, 1e-6))
      << "sublayer weight";
  // parameter gradients accumulate over a second backward
  const Tensor g1 = site.fn().grad.clone();
  Chain::State st2;
  chain.forward(Context{}, x, st2);
  chain.backward(Context{}, G, st2);
  const auto a = site.fn().grad.to_f64_vector(), b = g1.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], 2 * b[i], 1e-12 * (1 + std::fabs(b[i])));
}

TEST(MhcSiteModule, RecomputeIsBitIdentical) {
  Rng rng(test_seed());
  MhcSite site(site_cfg(16, DType::f32, test_seed(), 0.05), MhcSiteKind::attn, PrecisionPolicy{},
               "model.layers.1");
  randomize(site, rng);
  const Tensor x = randn({6, 4, 16}, DType::f32, rng), y = randn({6, 16}, DType::f32, rng);
  const Tensor G = randn({6, 4, 16}, DType::f32, rng), du = randn({6, 16}, DType::f32, rng);
  Tensor xo[2], dy[2], dx[2], dfn[2], dsc[2];
  for (int r = 0; r < 2; ++r) {
    const Context ctx{true, r == 1};
    MhcSite::Saved s;
    site.collapse(ctx, x, s);
    xo[r] = site.write_back(ctx, y, s);
    EXPECT_EQ(s.maps.comb.defined(), r == 0);  // dropped under recompute
    site.zero_grad();
    const MhcSite::Partial p = site.backward_write_back(ctx, G, s);
    EXPECT_EQ(p.maps.comb.defined(), r == 1);  // recomputed
    dy[r] = p.dy;
    dx[r] = site.backward_collapse(ctx, du, s, p);
    dfn[r] = site.fn().grad.clone();
    dsc[r] = site.scale().grad.clone();
  }
  EXPECT_TRUE(bit_equal(xo[0], xo[1]));
  EXPECT_TRUE(bit_equal(dy[0], dy[1]));
  EXPECT_TRUE(bit_equal(dx[0], dx[1]));
  EXPECT_TRUE(bit_equal(dfn[0], dfn[1]));
  EXPECT_TRUE(bit_equal(dsc[0], dsc[1]));
}

TEST(MhcSiteModule, PackedBatchEqualsSequencesBitwise) {
  Rng rng(test_seed());
  MhcSite site(site_cfg(12, DType::f32, test_seed(), 0.05), MhcSiteKind::ffn, PrecisionPolicy{},
               "model.layers.1");
  randomize(site, rng);
  const int64_t T = 9, D = 12;
  const Tensor x = randn({T, 4, D}, DType::f32, rng), y = randn({T, D}, DType::f32, rng);
  const Tensor G = randn({T, 4, D}, DType::f32, rng), du = randn({T, D}, DType::f32, rng);
  MhcSite::Saved s;
  const Tensor u = site.collapse(Context{}, x, s);
  const Tensor xo = site.write_back(Context{}, y, s);
  const MhcSite::Partial p = site.backward_write_back(Context{}, G, s);
  const Tensor dx = site.backward_collapse(Context{}, du, s, p);
  int64_t t0 = 0;
  for (int64_t L : {2, 1, 6}) {
    auto sl = [&](const Tensor& t) { return t.slice(0, t0, t0 + L).contiguous(); };
    MhcSite::Saved si;
    EXPECT_TRUE(bit_equal(site.collapse(Context{}, sl(x), si), sl(u)));
    EXPECT_TRUE(bit_equal(site.write_back(Context{}, sl(y), si), sl(xo)));
    const MhcSite::Partial pi = site.backward_write_back(Context{}, sl(G), si);
    EXPECT_TRUE(bit_equal(pi.dy, sl(p.dy)));
    EXPECT_TRUE(bit_equal(site.backward_collapse(Context{}, sl(du), si, pi), sl(dx)));
    t0 += L;
  }
}

TEST(MhcSiteModule, Bf16StreamsStoreBf16AndGradientsFollowTheirInputs) {
  Rng rng(test_seed());
  MhcSite site(site_cfg(16, DType::f32, test_seed(), 0.05), MhcSiteKind::attn, PrecisionPolicy{},
               "model.layers.0");
  randomize(site, rng);
  const Tensor x = randn({5, 4, 16}, DType::f32, rng).to(DType::bf16);
  const Tensor y = randn({5, 16}, DType::f32, rng);
  const Tensor G = randn({5, 4, 16}, DType::f32, rng), du = randn({5, 16}, DType::f32, rng);
  MhcSite::Saved s, s32;
  const Tensor u = site.collapse(Context{}, x, s);
  const Tensor u32 = site.collapse(Context{}, x.to(DType::f32), s32);
  EXPECT_EQ(u.dtype(), DType::bf16);
  EXPECT_TRUE(bit_equal(u, u32.to(DType::bf16)));  // FP32 arithmetic, one bf16 store
  const Tensor xo = site.write_back(Context{}, y, s);
  EXPECT_EQ(xo.dtype(), DType::bf16);
  EXPECT_TRUE(bit_equal(xo, site.write_back(Context{}, y, s32).to(DType::bf16)));
  const MhcSite::Partial p = site.backward_write_back(Context{}, G, s);
  EXPECT_EQ(p.dy.dtype(), DType::f32);  // y was f32
  EXPECT_EQ(site.backward_collapse(Context{}, du, s, p).dtype(), DType::bf16);
  MhcSite::Saved sb;
  site.collapse(Context{}, x, sb);
  site.write_back(Context{}, y.to(DType::bf16), sb);
  EXPECT_EQ(site.backward_write_back(Context{}, G, sb).dy.dtype(), DType::bf16);
}

TEST(MhcSiteModule, InferenceBadInputsAndBadConfigThrow) {
  Rng rng(test_seed());
  const PrecisionPolicy pol;
  MhcSite site(site_cfg(8, DType::f32, 3), MhcSiteKind::attn, pol, "model.layers.0");
  const Tensor x = randn({3, 4, 8}, DType::f32, rng), y = randn({3, 8}, DType::f32, rng);
  const Tensor G = randn({3, 4, 8}, DType::f32, rng);
  // inference: write_back empties Saved, backward refuses it
  MhcSite::Saved si;
  site.collapse(Context{false, false}, x, si);
  site.write_back(Context{false, false}, y, si);
  EXPECT_FALSE(si.x.defined());
  expect_error([&] { site.backward_write_back(Context{}, G, si); }, "Saved");
  MhcSite::Saved s;
  expect_error([&] { site.write_back(Context{}, y, s); }, "collapse");
  expect_error(
      [&] {
        site.collapse(Context{}, randn({3, 3, 8}, DType::f32, rng), s);
      },
      "[T, 4, 8]");
  expect_error([&] { site.collapse(Context{}, Tensor::zeros({3, 4, 8}, DType::i64), s); }, "f64");
  site.collapse(Context{}, x, s);
  expect_error([&] { site.write_back(Context{}, randn({3, 7}, DType::f32, rng), s); }, "y must");
  site.write_back(Context{}, y, s);
  expect_error(
      [&] {
        site.backward_write_back(Context{}, randn({3, 4, 7}, DType::f32, rng), s);
      },
      "dX'");
  expect_error([&] { site.backward_collapse(Context{}, y, s, MhcSite::Partial{}); }, "Partial");
  const MhcSite::Partial p = site.backward_write_back(Context{}, G, s);
  expect_error(
      [&] {
        site.backward_collapse(Context{}, randn({2, 8}, DType::f32, rng), s, p);
      },
      "du");
  // config
  auto make = [&](const MhcSiteConfig& c) { MhcSite m(c, MhcSiteKind::ffn, pol, "l"); };
  MhcSiteConfig c = site_cfg(0, DType::f32, 0);
  expect_error([&] { make(c); }, "hidden_size");
  c = site_cfg(8, DType::f32, 0);
  c.hc_mult = 0;
  expect_error([&] { make(c); }, "hc_mult");
  c = site_cfg(8, DType::f32, 0);
  c.sinkhorn_iters = 0;
  expect_error([&] { make(c); }, "sinkhorn_iters");
  c = site_cfg(8, DType::f32, 0);
  c.hc_eps = -1e-6;
  expect_error([&] { make(c); }, "hc_eps");
  c = site_cfg(8, DType::f32, 0);
  c.norm_eps = std::nan("");
  expect_error([&] { make(c); }, "norm_eps");
  c = site_cfg(8, DType::f32, 0);
  c.init = MhcInit::residual;
  c.hc_mult = 1;
  expect_error([&] { make(c); }, "hc_mult");
  c = site_cfg(8, DType::i32, 0);
  expect_error([&] { make(c); }, "dtype");
  c = site_cfg(8, DType::f32, 0);
  c.init_std = -0.1;
  expect_error([&] { make(c); }, "init_std");
}

}  // namespace
}  // namespace hlm
