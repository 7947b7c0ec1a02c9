// Tests of ops/mhc.h against plain-loop FP64 references written here from docs/mhc_moe.md ("mHC"),
// plus central finite differences of every input and parameter.
#include "ops/mhc.h"

#include <cmath>
#include <vector>

#include "ops/rmsnorm.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::close;
using hlm::testing::dot;
using hlm::testing::grad_check;
using hlm::testing::test_seed;

double sigm(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Reference Sinkhorn, one n x n matrix (row-major), the contract form.
std::vector<double> ref_sinkhorn(std::vector<double> L, int n, double eps, int iters) {
  std::vector<double> M(n * n);
  for (int i = 0; i < n; ++i) {
    double mx = -1e300, s = 0;
    for (int j = 0; j < n; ++j) mx = std::max(mx, L[i * n + j]);
    for (int j = 0; j < n; ++j) s += std::exp(L[i * n + j] - mx);
    for (int j = 0; j < n; ++j) M[i * n + j] = std::exp(L[i * n + j] - mx) / s + eps;
  }
  auto colnorm = [&] {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int i = 0; i < n; ++i) s += M[i * n + j];
      for (int i = 0; i < n; ++i) M[i * n + j] /= (s + eps);
    }
  };
  auto rownorm = [&] {
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < n; ++j) s += M[i * n + j];
      for (int j = 0; j < n; ++j) M[i * n + j] /= (s + eps);
    }
  };
  colnorm();
  for (int it = 1; it < iters; ++it) rownorm(), colnorm();
  return M;
}

struct RefSite {
  std::vector<double> u, xo, pre, post, comb, inv_rms;
};

// Reference site: x [T, n, D], fn [(2+n)n, nD], base, scale, y [T, D] (sublayer output).
RefSite ref_site(const Tensor& xt, const Tensor& fnt, const Tensor& bt, const Tensor& st,
                 const Tensor& yt, const MhcConfig& c) {
  const auto x = xt.to_f64_vector(), fn = fnt.to_f64_vector(), b = bt.to_f64_vector(),
             sc = st.to_f64_vector(), y = yt.to_f64_vector();
  const int T = int(xt.size(0)), n = int(xt.size(1)), D = int(xt.size(2)), K = n * D,
            m = (2 + n) * n;
  RefSite r;
  r.u.assign(T * D, 0);
  r.xo.assign(T * n * D, 0);
  for (int t = 0; t < T; ++t) {
    double ss = 0;
    for (int k = 0; k < K; ++k) ss += x[t * K + k] * x[t * K + k];
    const double inv = 1.0 / std::sqrt(ss / K + c.norm_eps);
    r.inv_rms.push_back(inv);
    std::vector<double> mix(m);
    for (int q = 0; q < m; ++q) {
      double a = 0;
      for (int k = 0; k < K; ++k) a += x[t * K + k] * inv * fn[q * K + k];
      mix[q] = a;
    }
    std::vector<double> pre(n), post(n), L(n * n);
    for (int j = 0; j < n; ++j) {
      pre[j] = sigm(mix[j] * sc[0] + b[j]) + c.hc_eps;
      post[j] = 2 * sigm(mix[n + j] * sc[1] + b[n + j]);
    }
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j)
        L[i * n + j] = mix[2 * n + n * i + j] * sc[2] + b[2 * n + n * i + j];
    const auto comb = ref_sinkhorn(L, n, c.hc_eps, int(c.sinkhorn_iters));
    for (int j = 0; j < n; ++j) r.pre.push_back(pre[j]), r.post.push_back(post[j]);
    for (double v : comb) r.comb.push_back(v);
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < n; ++j) r.u[t * D + d] += pre[j] * x[(t * n + j) * D + d];
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) {
        double v = post[i] * y[t * D + d];
        for (int j = 0; j < n; ++j) v += comb[j * n + i] * x[(t * n + j) * D + d];
        r.xo[(t * n + i) * D + d] = v;
      }
  }
  return r;
}

struct SiteInputs {
  Tensor x, y;
  MhcParams p;
};
SiteInputs make_site(int64_t T, int64_t n, int64_t D, DType dt, Rng& rng, double fn_std = 0.5) {
  SiteInputs s;
  s.x = randn({T, n, D}, dt, rng);
  s.y = randn({T, D}, dt, rng);
  s.p.fn = randn({(2 + n) * n, n * D}, dt, rng, fn_std);
  s.p.base = randn({(2 + n) * n}, dt, rng, 0.5);
  s.p.scale = rand_uniform({3}, dt, rng, 0.5, 1.5);
  return s;
}

Tensor vec_tensor(const std::vector<double>& v, const Shape& s) {
  return Tensor::from_values(s, v, DType::f64);
}

TEST(MhcSinkhorn, MatchesReferenceAndIsNearlyDoublyStochastic) {
  Rng rng(test_seed());
  const int64_t T = 7, n = 4;
  Tensor L = randn({T, n, n}, DType::f64, rng, 2.0);
  Tensor comb = mhc_sinkhorn(L, 1e-6, 20);
  const auto lv = L.to_f64_vector();
  std::vector<double> ref;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(lv.begin() + t * n * n, lv.begin() + (t + 1) * n * n);
    for (double v : ref_sinkhorn(l, int(n), 1e-6, 20)) ref.push_back(v);
  }
  EXPECT_TRUE(close(comb, vec_tensor(ref, {T, n, n}), testing::tolerance_for(DType::f64)));
  const auto c = comb.to_f64_vector();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t a = 0; a < n; ++a) {
      double rs = 0, cs = 0;
      for (int64_t b = 0; b < n; ++b) rs += c[t * 16 + a * n + b], cs += c[t * 16 + b * n + a];
      EXPECT_NEAR(cs, 1.0, 1e-5) << "column " << a << " of token " << t;  // last step: columns
      EXPECT_NEAR(rs, 1.0, 1e-2) << "row " << a << " of token " << t;     // only approximately
    }
  // f32 matches the FP64 reference to FP32 accuracy.
  Tensor c32 = mhc_sinkhorn(L.to(DType::f32), 1e-6, 20);
  EXPECT_EQ(c32.dtype(), DType::f32);
  EXPECT_TRUE(close(c32, vec_tensor(ref, {T, n, n}), {1e-5, 1e-5}));
}

TEST(MhcSinkhorn, NoExactFinalProjection) {
  // One iteration = softmax + eps then a column normalisation: rows are NOT renormalised.
  Tensor L = Tensor::from_values({1, 2, 2}, {3.0, 0.0, 0.0, 0.0}, DType::f64);
  Tensor c = mhc_sinkhorn(L, 1e-6, 1);
  const auto ref = ref_sinkhorn({3.0, 0.0, 0.0, 0.0}, 2, 1e-6, 1);
  EXPECT_TRUE(close(c, vec_tensor(ref, {1, 2, 2}), testing::tolerance_for(DType::f64)));
  const auto v = c.to_f64_vector();
  EXPECT_GT(std::fabs(v[0] + v[1] - 1.0), 1e-2);  // row 0 sum is far from 1 after one iteration
}

TEST(MhcSinkhorn, BackwardFiniteDifferences) {
  Rng rng(test_seed());
  for (int64_t iters : {1, 3, 20}) {
    Tensor L = randn({3, 4, 4}, DType::f64, rng, 1.5);
    Tensor G = randn({3, 4, 4}, DType::f64, rng);
    Tensor dL = mhc_sinkhorn_backward(L, G, 1e-6, iters);
    auto loss = [&] { return dot(mhc_sinkhorn(L, 1e-6, iters), G); };
    EXPECT_TRUE(grad_check(loss, L, dL, 1e-6, 1e-7)) << "iters " << iters;
  }
}

TEST(MhcSite, ForwardMatchesReferenceF64AndF32) {
  Rng rng(test_seed());
  MhcConfig c;
  SiteInputs s = make_site(5, 4, 6, DType::f64, rng);
  MhcSiteSaved sv;
  Tensor u = mhc_site_begin(s.x, s.p, c, sv);
  Tensor xo = mhc_site_end(sv, s.y);
  RefSite r = ref_site(s.x, s.p.fn, s.p.base, s.p.scale, s.y, c);
  const auto tol = testing::tolerance_for(DType::f64);
  EXPECT_TRUE(close(u, vec_tensor(r.u, {5, 6}), tol));
  EXPECT_TRUE(close(xo, vec_tensor(r.xo, {5, 4, 6}), tol));
  EXPECT_TRUE(close(sv.maps.pre, vec_tensor(r.pre, {5, 4}), tol));
  EXPECT_TRUE(close(sv.maps.post, vec_tensor(r.post, {5, 4}), tol));
  EXPECT_TRUE(close(sv.maps.comb, vec_tensor(r.comb, {5, 4, 4}), tol));
  EXPECT_TRUE(close(sv.maps.inv_rms, vec_tensor(r.inv_rms, {5}), tol));
  // f32: every input cast to f32, the FP64 reference of those f32 values.
  SiteInputs f{s.x.to(DType::f32),
               s.y.to(DType::f32),
               {s.p.fn.to(DType::f32), s.p.base.to(DType::f32), s.p.scale.to(DType::f32)}};
  RefSite rf = ref_site(f.x, f.p.fn, f.p.base, f.p.scale, f.y, c);
  MhcSiteSaved s32;
  Tensor u32 = mhc_site_begin(f.x, f.p, c, s32);
  Tensor xo32 = mhc_site_end(s32, f.y);
  EXPECT_EQ(u32.dtype(), DType::f32);
  EXPECT_TRUE(close(u32, vec_tensor(rf.u, {5, 6}), {2e-5, 2e-4}));
  EXPECT_TRUE(close(xo32, vec_tensor(rf.xo, {5, 4, 6}), {2e-5, 2e-4}));
}

// Collapse and norm in one op: u of the FP64 reference site, then u rstd w with eps inside the
// sqrt; pre / post / comb the reference's; bf16 streams round u to bf16 before the norm.
TEST(MhcSite, CollapseNormMatchesReference) {
  Rng rng(test_seed());
  MhcConfig c;
  SiteInputs s = make_site(5, 4, 6, DType::f64, rng);
  const Tensor w = rand_uniform({6}, DType::f64, rng, 0.5, 1.5);
  const double eps = 1e-5;
  const MhcCollapseNormed r = mhc_collapse_norm(s.x, s.p, c, w, eps);
  const RefSite ref = ref_site(s.x, s.p.fn, s.p.base, s.p.scale, s.y, c);
  std::vector<double> a(30);
  const auto wv = w.to_f64_vector();
  for (int t = 0; t < 5; ++t) {
    double ss = 0;
    for (int e = 0; e < 6; ++e) ss += ref.u[size_t(t * 6 + e)] * ref.u[size_t(t * 6 + e)];
    const double rstd = 1.0 / std::sqrt(ss / 6 + eps);
    for (int e = 0; e < 6; ++e)
      a[size_t(t * 6 + e)] = ref.u[size_t(t * 6 + e)] * rstd * wv[size_t(e)];
  }
  const auto tol = testing::tolerance_for(DType::f64);
  EXPECT_TRUE(close(r.a, vec_tensor(a, {5, 6}), tol));
  EXPECT_TRUE(close(r.pre, vec_tensor(ref.pre, {5, 4}), tol));
  EXPECT_TRUE(close(r.post, vec_tensor(ref.post, {5, 4}), tol));
  EXPECT_TRUE(close(r.comb, vec_tensor(ref.comb, {5, 4, 4}), tol));
  // bf16 streams: a in bf16, from the bf16 u the collapse stores.
  const Tensor xb = s.x.to(DType::bf16);
  const MhcCollapseNormed rb = mhc_collapse_norm(xb, s.p, c, w.to(DType::f32), eps);
  EXPECT_EQ(rb.a.dtype(), DType::bf16);
  MhcSiteSaved sv;
  const Tensor ub = mhc_site_begin(xb, s.p, c, sv);
  EXPECT_EQ(ub.dtype(), DType::bf16);
  const RmsNormResult nr = rmsnorm_forward(ub.to(DType::f32), w.to(DType::f32), eps);
  EXPECT_TRUE(testing::bit_equal(rb.a, nr.y.to(DType::bf16)));
  // Bad input: a weight of the wrong width, a negative or NaN eps.
  EXPECT_THROW(mhc_collapse_norm(s.x, s.p, c, randn({5}, DType::f64, rng), eps), Error);
  EXPECT_THROW(mhc_collapse_norm(s.x, s.p, c, w, -1.0), Error);
  EXPECT_THROW(mhc_collapse_norm(s.x, s.p, c, w, std::nan("")), Error);
}

TEST(MhcSite, EpsInsideSqrtAtSmallStreamRms) {
  // GLM's layer-0 stream RMS ~ 0.0079: inv_rms must be rsqrt(mean(x^2) + 1e-5), not
  // 1 / (rms + 1e-6).
  Rng rng(test_seed());
  Tensor x = randn({2, 4, 64}, DType::f64, rng, 0.0079);
  Tensor r = mhc_inv_rms(x, 1e-5);
  const auto xv = x.to_f64_vector();
  for (int t = 0; t < 2; ++t) {
    double ss = 0;
    for (int k = 0; k < 256; ++k) ss += xv[t * 256 + k] * xv[t * 256 + k];
    const double want = 1.0 / std::sqrt(ss / 256 + 1e-5);
    const double wrong = 1.0 / (std::sqrt(ss / 256) + 1e-6);
    EXPECT_NEAR(r.at({t}), want, 1e-12 * want);
    EXPECT_GT(std::fabs(r.at({t}) - wrong) / wrong, 0.05);
  }
  Tensor G = randn({2}, DType::f64, rng);
  Tensor dx = mhc_inv_rms_backward(x, r, G);
  auto loss = [&] { return dot(mhc_inv_rms(x, 1e-5), G); };
  EXPECT_TRUE(grad_check(loss, x, dx, 1e-8, 1e-6));
}

TEST(MhcSite, BackwardFiniteDifferencesAllInputsAndParams) {
  Rng rng(test_seed());
  MhcConfig c;
  const int64_t T = 3, n = 4, D = 5;
  SiteInputs s = make_site(T, n, D, DType::f64, rng);
  Tensor G = randn({T, n, D}, DType::f64, rng);
  Tensor W = randn({T, D}, DType::f64, rng);
  // Sublayer F(u) = sin(u) * W + y0: the site input and output both carry gradient.
  auto sub = [&](const Tensor& u) {
    const auto uv = u.to_f64_vector(), wv = W.to_f64_vector(), yv = s.y.to_f64_vector();
    std::vector<double> o(uv.size());
    for (size_t i = 0; i < o.size(); ++i) o[i] = std::sin(uv[i]) * wv[i] + yv[i];
    return Tensor::from_values(u.shape(), o, DType::f64);
  };
  auto loss = [&] {
    MhcSiteSaved sv;
    Tensor u = mhc_site_begin(s.x, s.p, c, sv);
    return dot(mhc_site_end(sv, sub(u)), G);
  };
  MhcSiteSaved sv;
  Tensor u = mhc_site_begin(s.x, s.p, c, sv);
  mhc_site_end(sv, sub(u));
  Tensor dy = mhc_site_backward_dy(sv, G);
  const auto uv = u.to_f64_vector(), wv = W.to_f64_vector(), dyv = dy.to_f64_vector();
  std::vector<double> du(uv.size());
  for (size_t i = 0; i < du.size(); ++i) du[i] = dyv[i] * std::cos(uv[i]) * wv[i];
  MhcParamGrads g{Tensor::zeros(s.p.fn.shape(), DType::f64),
                  Tensor::zeros(s.p.base.shape(), DType::f64), Tensor::zeros({3}, DType::f64)};
  Tensor dx = mhc_site_backward(sv, G, Tensor::from_values({T, D}, du, DType::f64), g);
  EXPECT_TRUE(grad_check(loss, s.x, dx, 1e-6, 1e-6, 60)) << "dx";
  EXPECT_TRUE(grad_check(loss, s.p.fn, g.dfn, 1e-6, 1e-6, 120)) << "dfn";
  EXPECT_TRUE(grad_check(loss, s.p.base, g.dbase, 1e-6, 1e-6, 24)) << "dbase";
  EXPECT_TRUE(grad_check(loss, s.p.scale, g.dscale, 1e-6, 1e-6, 3)) << "dscale";
  EXPECT_TRUE(grad_check(loss, s.y, dy, 1e-6, 1e-6)) << "dy (through y0)";
  // Parameter gradients accumulate: a second backward doubles them.
  Tensor dfn1 = g.dfn.clone();
  mhc_site_backward(sv, G, Tensor::from_values({T, D}, du, DType::f64), g);
  const auto a = g.dfn.to_f64_vector(), b = dfn1.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], 2 * b[i], 1e-12 * (1 + std::fabs(b[i])));
}

TEST(MhcSite, PiecesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t T = 2, n = 4, D = 3;
  Tensor x = randn({T, n, D}, DType::f64, rng), y = randn({T, D}, DType::f64, rng);
  Tensor pre = randn({T, n}, DType::f64, rng), post = randn({T, n}, DType::f64, rng);
  Tensor comb = randn({T, n, n}, DType::f64, rng);
  Tensor G = randn({T, n, D}, DType::f64, rng), Gu = randn({T, D}, DType::f64, rng);
  auto wl = [&] { return dot(mhc_write_back(x, y, post, comb), G); };
  MhcWriteBackGrads wg = mhc_write_back_backward(x, y, post, comb, G);
  EXPECT_TRUE(grad_check(wl, x, wg.dx));
  EXPECT_TRUE(grad_check(wl, y, wg.dy));
  EXPECT_TRUE(grad_check(wl, post, wg.dpost));
  EXPECT_TRUE(grad_check(wl, comb, wg.dcomb));
  auto cl = [&] { return dot(mhc_collapse(x, pre), Gu); };
  MhcCollapseGrads cg = mhc_collapse_backward(x, pre, Gu);
  EXPECT_TRUE(grad_check(cl, x, cg.dx));
  EXPECT_TRUE(grad_check(cl, pre, cg.dpre));
  // the transpose: X'_0 of a pure permutation comb with post = 0
  Tensor perm = Tensor::zeros({T, n, n}, DType::f64);
  for (int64_t t = 0; t < T; ++t) perm.select(0, t).select(0, 1).select(0, 0).fill_(1.0);  // [1][0]
  Tensor xo = mhc_write_back(x, y, Tensor::zeros({T, n}, DType::f64), perm);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(xo.at({0, 0, d}), x.at({0, 1, d}));  // X'_0 = X_1
}

TEST(MhcModel, ExpandAndMeanContract) {
  Rng rng(test_seed());
  Tensor e = randn({3, 5}, DType::f64, rng);
  Tensor x = mhc_expand(e, 4);
  ASSERT_EQ(x.shape(), Shape({3, 4, 5}));
  for (int64_t j = 0; j < 4; ++j) EXPECT_TRUE(testing::bit_equal(x.select(1, j).contiguous(), e));
  // mean of identical streams is the stream itself
  EXPECT_TRUE(close(mhc_mean_contract(x), e, testing::tolerance_for(DType::f64)));
  Tensor xs = randn({3, 4, 5}, DType::f64, rng);
  Tensor G = randn({3, 5}, DType::f64, rng), G3 = randn({3, 4, 5}, DType::f64, rng);
  const auto xv = xs.to_f64_vector();
  std::vector<double> mean(15, 0);
  for (int t = 0; t < 3; ++t)
    for (int d = 0; d < 5; ++d)
      for (int j = 0; j < 4; ++j) mean[t * 5 + d] += xv[(t * 4 + j) * 5 + d] / 4;
  EXPECT_TRUE(close(mhc_mean_contract(xs), vec_tensor(mean, {3, 5}), {1e-15, 1e-14}));
  EXPECT_TRUE(grad_check([&] { return dot(mhc_mean_contract(xs), G); }, xs,
                         mhc_mean_contract_backward(G, 4)));
  EXPECT_TRUE(grad_check([&] { return dot(mhc_expand(e, 4), G3); }, e, mhc_expand_backward(G3)));
}

TEST(MhcSite, DeterministicBitIdentical) {
  Rng rng(test_seed());
  MhcConfig c;
  SiteInputs s = make_site(9, 4, 32, DType::f32, rng, 0.05);
  Tensor G = randn({9, 4, 32}, DType::f32, rng), du = randn({9, 32}, DType::f32, rng);
  Tensor out[2], dx[2], dfn[2];
  for (int r = 0; r < 2; ++r) {
    MhcSiteSaved sv;
    mhc_site_begin(s.x, s.p, c, sv);
    out[r] = mhc_site_end(sv, s.y);
    MhcParamGrads g{Tensor::zeros(s.p.fn.shape(), DType::f32), Tensor::zeros({24}, DType::f32),
                    Tensor::zeros({3}, DType::f32)};
    dx[r] = mhc_site_backward(sv, G, du, g);
    dfn[r] = g.dfn;
  }
  EXPECT_TRUE(testing::bit_equal(out[0], out[1]));
  EXPECT_TRUE(testing::bit_equal(dx[0], dx[1]));
  EXPECT_TRUE(testing::bit_equal(dfn[0], dfn[1]));
}

TEST(MhcSite, Bf16StreamsStoreBf16) {
  Rng rng(test_seed());
  MhcConfig c;
  SiteInputs s = make_site(4, 4, 16, DType::f32, rng, 0.1);
  Tensor xb = s.x.to(DType::bf16);
  MhcSiteSaved sv;
  Tensor u = mhc_site_begin(xb, s.p, c, sv);
  Tensor xo = mhc_site_end(sv, s.y);
  EXPECT_EQ(u.dtype(), DType::bf16);
  EXPECT_EQ(xo.dtype(), DType::bf16);
  RefSite r = ref_site(xb, s.p.fn, s.p.base, s.p.scale, s.y, c);
  EXPECT_TRUE(close(u, vec_tensor(r.u, {4, 16}), testing::tolerance_for(DType::bf16)));
  EXPECT_TRUE(close(xo, vec_tensor(r.xo, {4, 4, 16}), testing::tolerance_for(DType::bf16)));
}

TEST(MhcSite, BadInputThrows) {
  Rng rng(test_seed());
  MhcConfig c;
  SiteInputs s = make_site(2, 4, 3, DType::f64, rng);
  MhcSiteSaved sv;
  MhcParams bad = s.p;
  bad.fn = randn({24, 11}, DType::f64, rng);
  EXPECT_THROW(mhc_site_begin(s.x, bad, c, sv), Error);
  bad = s.p;
  bad.base = randn({23}, DType::f64, rng);
  EXPECT_THROW(mhc_site_begin(s.x, bad, c, sv), Error);
  bad = s.p;
  bad.scale = randn({2}, DType::f64, rng);
  EXPECT_THROW(mhc_site_begin(s.x, bad, c, sv), Error);
  EXPECT_THROW(mhc_site_begin(randn({2, 3, 3}, DType::f64, rng), s.p, c, sv), Error);  // n != 4
  EXPECT_THROW(mhc_site_begin(randn({2, 12}, DType::f64, rng), s.p, c, sv), Error);
  MhcConfig c0 = c;
  c0.sinkhorn_iters = 0;
  EXPECT_THROW(mhc_site_begin(s.x, s.p, c0, sv), Error);
  EXPECT_THROW(mhc_site_end(sv, s.y), Error);  // no begin yet
  mhc_site_begin(s.x, s.p, c, sv);
  EXPECT_THROW(mhc_site_end(sv, randn({2, 4}, DType::f64, rng)), Error);
  mhc_site_end(sv, s.y);
  EXPECT_THROW(mhc_site_backward_dy(sv, randn({2, 4, 4}, DType::f64, rng)), Error);
  MhcParamGrads g;  // undefined accumulators
  EXPECT_THROW(
      mhc_site_backward(sv, randn({2, 4, 3}, DType::f64, rng), randn({2, 3}, DType::f64, rng), g),
      Error);
  EXPECT_THROW(mhc_sinkhorn(randn({2, 3, 4}, DType::f64, rng), 1e-6, 20), Error);
  EXPECT_THROW(mhc_collapse(s.x, randn({2, 3}, DType::f64, rng)), Error);
}

}  // namespace
}  // namespace hlm::ops
