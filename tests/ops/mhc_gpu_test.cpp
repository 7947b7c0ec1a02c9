// CUDA mHC (ops/mhc.h) against the CPU op on the same inputs (the same tensors, copied to the
// device): every output and gradient of collapse, write-back, expand, mean contract, inv_rms,
// Sinkhorn, the mappings and a whole site, forward and backward. Streams f32, f64 and bf16 (bf16
// with f32 parameters, as the CPU reads them), T = 1, 5, 67 tokens, n = 4 and 2 streams (n = 1, 3,
// 5, 8 for Sinkhorn), D = 64 and 96; strided and mixed-dtype inputs; an empty batch. Outputs are
// NaN-poisoned; every GPU result is computed twice and the two runs must agree bit for bit. Bounds
// (gpu_compare.h): f32 outputs max error / max |ref| <= 2e-5, f64 <= 1e-12, bf16 outputs (u, X',
// expand, contract of bf16 streams) relative L2 <= 2e-3. Bad input is refused with one line.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_compare.h"
#include "ops/dispatch.h"
#include "ops/mhc.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

using Outs = std::vector<std::pair<std::string, Tensor>>;

// A CPU tensor and its copy on the GPU.
struct In2 {
  Tensor h, d;
  const Tensor& on(bool g) const { return g ? d : h; }
};
In2 both(const Tensor& h) {
  return {h, h.defined() ? gpu(h) : Tensor()};
}

DType comp(DType dt) {
  return dt == DType::f64 ? DType::f64 : DType::f32;
}

// Standard normal values drawn in the computation dtype, stored in dt (bf16 rounds them).
In2 normal(const Shape& s, DType dt, Rng& rng, double std = 1.0) {
  return both(randn(s, comp(dt), rng, std).to(dt));
}
In2 uniform(const Shape& s, DType dt, Rng& rng, double lo, double hi) {
  return both(rand_uniform(s, comp(dt), rng, lo, hi).to(dt));
}

// Runs f on the CPU inputs and twice on the GPU inputs; every GPU output must be a CUDA tensor of
// the CPU output's dtype and shape, within the bound of the computation dtype cd (of bf16 for a
// bf16 output), and the same bits both runs.
void compare_runs(const std::string& label, DType cd, const std::function<Outs(bool)>& f) {
  SCOPED_TRACE(label);
  std::printf("%s\n", label.c_str());
  const Outs ref = f(false), a = f(true), b = f(true);
  ASSERT_EQ(ref.size(), a.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const std::string& what = ref[i].first;
    const Tensor &r = ref[i].second, &o = a[i].second;
    ASSERT_TRUE(o.defined()) << what;
    EXPECT_EQ(o.device(), Device::cuda) << what;
    ASSERT_EQ(o.dtype(), r.dtype()) << what;
    ASSERT_EQ(o.shape(), r.shape()) << what;
    gpu_compare::check(what.c_str(), o, r, r.dtype() == DType::bf16 ? DType::bf16 : cd);
    EXPECT_TRUE(testing::bit_equal(cpu(o), cpu(b[i].second))) << what << ": reruns differ";
  }
}

std::string label(const char* what, DType dt, int64_t T, int64_t n, int64_t D) {
  return std::string(what) + " " + dtype_name(dt) + " T=" + std::to_string(T) +
         " n=" + std::to_string(n) + " D=" + std::to_string(D);
}

struct Geo {
  int64_t n, D;
};
const std::vector<int64_t> kTokens = {1, 5, 67};
const std::vector<Geo> kGeos = {{4, 64}, {2, 96}};
const std::vector<DType> kDtypes = {DType::f32, DType::f64, DType::bf16};

TEST(MhcGpu, CollapseWriteBackExpandContractMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : kDtypes)
    for (int64_t T : kTokens)
      for (const Geo& g : kGeos) {
        const int64_t n = g.n, D = g.D;
        const DType cd = comp(dt);
        const In2 x = normal({T, n, D}, dt, rng), y = normal({T, D}, dt, rng);
        const In2 pre = uniform({T, n}, cd, rng, 0.2, 1.2), post = uniform({T, n}, cd, rng, 0, 2);
        const In2 comb = uniform({T, n, n}, cd, rng, 0, 1);
        const In2 du = normal({T, D}, dt, rng), G = normal({T, n, D}, dt, rng);
        compare_runs(label("collapse / write-back", dt, T, n, D), cd, [&](bool d) {
          const ops::MhcCollapseGrads cg = ops::mhc_collapse_backward(x.on(d), pre.on(d), du.on(d));
          const ops::MhcWriteBackGrads wg =
              ops::mhc_write_back_backward(x.on(d), y.on(d), post.on(d), comb.on(d), G.on(d));
          return Outs{
              {"collapse u", ops::mhc_collapse(x.on(d), pre.on(d))},
              {"collapse dx", cg.dx},
              {"collapse dpre", cg.dpre},
              {"write_back X'", ops::mhc_write_back(x.on(d), y.on(d), post.on(d), comb.on(d))},
              {"write_back dx", wg.dx},
              {"write_back dy", wg.dy},
              {"write_back dpost", wg.dpost},
              {"write_back dcomb", wg.dcomb}};
        });
        compare_runs(label("expand / mean contract", dt, T, n, D), cd, [&](bool d) {
          return Outs{{"expand", ops::mhc_expand(y.on(d), n)},
                      {"expand_backward", ops::mhc_expand_backward(G.on(d))},
                      {"mean_contract", ops::mhc_mean_contract(x.on(d))},
                      {"mean_contract_backward", ops::mhc_mean_contract_backward(du.on(d), n)}};
        });
      }
}

TEST(MhcGpu, InvRmsMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : kDtypes)
    for (int64_t T : kTokens)
      for (const Geo& g : kGeos) {
        const In2 x = normal({T, g.n, g.D}, dt, rng, 0.3);
        const In2 ir = both(ops::mhc_inv_rms(x.h, 1e-5));
        const In2 dir = normal({T}, comp(dt), rng);
        compare_runs(label("inv_rms", dt, T, g.n, g.D), comp(dt), [&](bool d) {
          return Outs{
              {"inv_rms", ops::mhc_inv_rms(x.on(d), 1e-5)},
              {"inv_rms eps 0.1", ops::mhc_inv_rms(x.on(d), 0.1)},
              {"inv_rms_backward", ops::mhc_inv_rms_backward(x.on(d), ir.on(d), dir.on(d))}};
        });
      }
}

TEST(MhcGpu, SinkhornMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  struct Case {
    int64_t T, n;
  };
  std::vector<Case> cases;
  for (int64_t T : kTokens)
    for (int64_t n : {2, 4}) cases.push_back({T, n});
  for (int64_t n : {1, 3, 5, 8}) cases.push_back({5, n});
  for (DType dt : kDtypes)
    for (const Case& c : cases)
      for (int64_t iters : {1, 2, 20})
        for (double std : {1.0, 8.0}) {
          if (std > 1 && iters != 20) continue;  // large logits (near one-hot rows): iters 20 only
          const In2 L = normal({c.T, c.n, c.n}, dt, rng, std);
          const In2 dc = normal({c.T, c.n, c.n}, dt, rng);
          const std::string lb = label("sinkhorn", dt, c.T, c.n, 0) +
                                 " iters=" + std::to_string(iters) + " std=" + std::to_string(std);
          compare_runs(lb, comp(dt), [&](bool d) {
            return Outs{
                {"sinkhorn", ops::mhc_sinkhorn(L.on(d), 1e-6, iters)},
                {"sinkhorn eps 1e-3", ops::mhc_sinkhorn(L.on(d), 1e-3, iters)},
                {"sinkhorn_backward", ops::mhc_sinkhorn_backward(L.on(d), dc.on(d), 1e-6, iters)},
                {"sinkhorn_backward eps 1e-3",
                 ops::mhc_sinkhorn_backward(L.on(d), dc.on(d), 1e-3, iters)}};
          });
        }
}

// Parameters of one site: fn ~ N(0, 1 / K) (mix ~ N(0, 1)), base ~ N(0, 0.5^2), scale in
// [0.5, 1.5], in pdt.
struct Params2 {
  In2 fn, base, scale;
  ops::MhcParams on(bool d) const { return {fn.on(d), base.on(d), scale.on(d)}; }
};
Params2 make_params(int64_t n, int64_t D, DType pdt, Rng& rng) {
  const int64_t m = (2 + n) * n, K = n * D;
  return {normal({m, K}, pdt, rng, 1.0 / std::sqrt(double(K))), normal({m}, pdt, rng, 0.5),
          uniform({3}, pdt, rng, 0.5, 1.5)};
}

// Accumulators starting at random values (the gradients add to them).
struct Grads2 {
  Tensor dfn, dbase, dscale;
  ops::MhcParamGrads fresh(bool d) const {
    auto c = [&](const Tensor& t) { return d ? gpu(t) : t.clone(); };
    return {c(dfn), c(dbase), c(dscale)};
  }
};
Grads2 make_grads(int64_t n, int64_t D, DType adt, Rng& rng) {
  const int64_t m = (2 + n) * n;
  return {randn({m, n * D}, adt, rng, 0.1), randn({m}, adt, rng, 0.1), randn({3}, adt, rng, 0.1)};
}

TEST(MhcGpu, MappingsMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : kDtypes)
    for (int64_t T : kTokens)
      for (const Geo& g : kGeos) {
        const int64_t n = g.n, D = g.D;
        const DType cd = comp(dt);
        ops::MhcConfig c;
        c.n = n;
        const In2 x = normal({T, n, D}, dt, rng);
        const Params2 p = make_params(n, D, cd, rng);
        // The saved mappings for the backward: the CPU's, on both devices.
        const ops::MhcMappings mh = ops::mhc_mappings_forward(x.h, p.on(false), c);
        const ops::MhcMappings md{gpu(mh.inv_rms), gpu(mh.mix),         gpu(mh.pre),
                                  gpu(mh.post),    gpu(mh.comb_logits), gpu(mh.comb)};
        const In2 dpre = normal({T, n}, cd, rng), dpost = normal({T, n}, cd, rng),
                  dcomb = normal({T, n, n}, cd, rng);
        // f32 / bf16 streams: f32 accumulators at T = 1 and 67, f64 ones at T = 5.
        const Grads2 g0 = make_grads(n, D, T == 5 ? DType::f64 : cd, rng);
        compare_runs(label("mappings", dt, T, n, D), cd, [&](bool d) {
          const ops::MhcMappings m = ops::mhc_mappings_forward(x.on(d), p.on(d), c);
          const ops::MhcMappings& sv = d ? md : mh;
          ops::MhcParamGrads gr = g0.fresh(d);
          const Tensor dx = ops::mhc_mappings_backward(x.on(d), p.on(d), c, sv, dpre.on(d),
                                                       dpost.on(d), dcomb.on(d), gr);
          // Only d comb (the Sinkhorn path), then only d pre and d post, into one accumulator.
          ops::MhcParamGrads g2 = g0.fresh(d);
          const Tensor dx2 = ops::mhc_mappings_backward(x.on(d), p.on(d), c, sv, Tensor(), Tensor(),
                                                        dcomb.on(d), g2);
          const Tensor dx3 = ops::mhc_mappings_backward(x.on(d), p.on(d), c, sv, dpre.on(d),
                                                        dpost.on(d), Tensor(), g2);
          return Outs{{"inv_rms", m.inv_rms},
                      {"mix", m.mix},
                      {"pre", m.pre},
                      {"post", m.post},
                      {"comb_logits", m.comb_logits},
                      {"comb", m.comb},
                      {"dx", dx},
                      {"dfn", gr.dfn},
                      {"dbase", gr.dbase},
                      {"dscale", gr.dscale},
                      {"dx (dcomb only)", dx2},
                      {"dx (dpre, dpost only)", dx3},
                      {"dfn (two calls)", g2.dfn},
                      {"dbase (two calls)", g2.dbase},
                      {"dscale (two calls)", g2.dscale}};
        });
      }
}

TEST(MhcGpu, CollapseNormMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  std::vector<Geo> geos = kGeos;
  geos.push_back({8, 40});   // the 8 x 8 Sinkhorn registers; flat in two slices of 256
  geos.push_back({3, 300});  // four slices, the last one part-full; n odd
  for (DType dt : kDtypes)
    for (int64_t T : kTokens)
      for (const Geo& g : geos) {
        const int64_t n = g.n, D = g.D;
        const DType cd = comp(dt);
        ops::MhcConfig c;
        c.n = n;
        const In2 x = normal({T, n, D}, dt, rng);
        const Params2 p = make_params(n, D, cd, rng);
        const In2 w = uniform({D}, cd, rng, 0.5, 1.5);
        compare_runs(label("collapse + norm", dt, T, n, D), cd, [&](bool d) {
          const ops::MhcCollapseNormed r =
              ops::mhc_collapse_norm(x.on(d), p.on(d), c, w.on(d), 1e-5);
          return Outs{{"a", r.a}, {"pre", r.pre}, {"post", r.post}, {"comb", r.comb}};
        });
      }
}

TEST(MhcGpu, SiteMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : kDtypes)
    for (int64_t T : kTokens)
      for (const Geo& g : kGeos) {
        const int64_t n = g.n, D = g.D;
        const DType cd = comp(dt);
        ops::MhcConfig c;
        c.n = n;
        const In2 x = normal({T, n, D}, dt, rng), y = normal({T, D}, dt, rng);
        const In2 dxo = normal({T, n, D}, dt, rng), du = normal({T, D}, dt, rng);
        const Params2 p = make_params(n, D, cd, rng);
        const Grads2 g0 = make_grads(n, D, cd, rng);
        compare_runs(label("site", dt, T, n, D), cd, [&](bool d) {
          ops::MhcSiteSaved s;
          const Tensor u = ops::mhc_site_begin(x.on(d), p.on(d), c, s);
          const Tensor xo = ops::mhc_site_end(s, y.on(d));
          const Tensor dy = ops::mhc_site_backward_dy(s, dxo.on(d));
          ops::MhcParamGrads gr = g0.fresh(d);
          const Tensor dx = ops::mhc_site_backward(s, dxo.on(d), du.on(d), gr);
          return Outs{{"site u", u},
                      {"site X'", xo},
                      {"site dy", dy},
                      {"site dx", dx},
                      {"site dfn", gr.dfn},
                      {"site dbase", gr.dbase},
                      {"site dscale", gr.dscale}};
        });
      }
}

// Strided views and inputs of different dtypes side by side (bf16 streams with an f32 y, f64
// mixing weights and parameters, f32 accumulators), as the CPU reads them.
TEST(MhcGpu, StridedAndMixedDtypeInputs) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  const int64_t T = 5, n = 4, D = 64;
  ops::MhcConfig c;
  // x: channels [1, D + 1) of [T, n, D + 3]; pre: a column slice; comb: transposed.
  const In2 xbig = normal({T, n, D + 3}, DType::f32, rng);
  const In2 pbig = uniform({T, n + 2}, DType::f32, rng, 0.2, 1.2);
  const In2 cbt = uniform({T, n, n}, DType::f32, rng, 0, 1);
  const In2 y = normal({T, D}, DType::f32, rng), post = uniform({T, n}, DType::f32, rng, 0, 2);
  const In2 G = normal({T, n, D}, DType::f32, rng);
  const Params2 p = make_params(n, D, DType::f32, rng);
  const Grads2 g0 = make_grads(n, D, DType::f32, rng);
  compare_runs("strided inputs", DType::f32, [&](bool d) {
    const Tensor x = xbig.on(d).slice(2, 1, D + 1), pre = pbig.on(d).slice(1, 1, n + 1);
    const Tensor comb = cbt.on(d).transpose(1, 2);
    const ops::MhcWriteBackGrads wg =
        ops::mhc_write_back_backward(x, y.on(d), post.on(d), comb, G.on(d));
    const ops::MhcMappings m = ops::mhc_mappings_forward(x, p.on(d), c);
    ops::MhcParamGrads gr = g0.fresh(d);
    const Tensor dxm = ops::mhc_mappings_backward(x, p.on(d), c, m, pre, post.on(d), comb, gr);
    return Outs{{"collapse u", ops::mhc_collapse(x, pre)},
                {"write_back X'", ops::mhc_write_back(x, y.on(d), post.on(d), comb)},
                {"write_back dx", wg.dx},
                {"write_back dcomb", wg.dcomb},
                {"mean_contract", ops::mhc_mean_contract(x)},
                {"mappings comb", m.comb},
                {"mappings dx", dxm},
                {"mappings dfn", gr.dfn}};
  });
  const In2 xb = normal({T, n, D}, DType::bf16, rng), yf = normal({T, D}, DType::f32, rng);
  const In2 pre64 = uniform({T, n}, DType::f64, rng, 0.2, 1.2);
  const In2 post64 = uniform({T, n}, DType::f64, rng, 0, 2);
  const In2 comb64 = uniform({T, n, n}, DType::f64, rng, 0, 1);
  const In2 du = normal({T, D}, DType::f32, rng), G64 = normal({T, n, D}, DType::f64, rng);
  const Params2 p64 = make_params(n, D, DType::f64, rng);
  compare_runs("mixed dtypes", DType::f32, [&](bool d) {
    const ops::MhcCollapseGrads cg = ops::mhc_collapse_backward(xb.on(d), pre64.on(d), du.on(d));
    const ops::MhcWriteBackGrads wg =
        ops::mhc_write_back_backward(xb.on(d), yf.on(d), post64.on(d), comb64.on(d), G64.on(d));
    ops::MhcSiteSaved s;
    const Tensor u = ops::mhc_site_begin(xb.on(d), p64.on(d), c, s);
    const Tensor xo = ops::mhc_site_end(s, yf.on(d));
    ops::MhcParamGrads gr = g0.fresh(d);
    const Tensor dx = ops::mhc_site_backward(s, G64.on(d), du.on(d), gr);
    return Outs{
        {"collapse u", ops::mhc_collapse(xb.on(d), pre64.on(d))},
        {"collapse dx", cg.dx},
        {"collapse dpre", cg.dpre},
        {"write_back X'", ops::mhc_write_back(xb.on(d), yf.on(d), post64.on(d), comb64.on(d))},
        {"write_back dx", wg.dx},
        {"write_back dy", wg.dy},
        {"write_back dcomb", wg.dcomb},
        {"expand f64", ops::mhc_expand(G64.on(d).select(1, 0), 3)},
        {"site u", u},
        {"site X'", xo},
        {"site dx", dx},
        {"site dfn", gr.dfn},
        {"site dbase", gr.dbase},
        {"site dscale", gr.dscale}};
  });
}

TEST(MhcGpu, EmptyBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const int64_t n = 4, D = 64;
  ops::MhcConfig c;
  const Tensor x = gpu(Tensor::zeros({0, n, D}, DType::f32));
  const Tensor y = gpu(Tensor::zeros({0, D}, DType::f32));
  const Params2 p = make_params(n, D, DType::f32, rng);
  const Grads2 g0 = make_grads(n, D, DType::f32, rng);
  ops::MhcSiteSaved s;
  const Tensor u = ops::mhc_site_begin(x, p.on(true), c, s);
  const Tensor xo = ops::mhc_site_end(s, y);
  EXPECT_EQ(u.shape(), Shape({0, D}));
  EXPECT_EQ(xo.shape(), Shape({0, n, D}));
  EXPECT_EQ(ops::mhc_site_backward_dy(s, x).shape(), Shape({0, D}));
  ops::MhcParamGrads gr = g0.fresh(true);
  EXPECT_EQ(ops::mhc_site_backward(s, x, y, gr).shape(), Shape({0, n, D}));
  EXPECT_TRUE(testing::bit_equal(cpu(gr.dfn), g0.dfn));  // nothing added
  EXPECT_TRUE(testing::bit_equal(cpu(gr.dscale), g0.dscale));
  EXPECT_EQ(ops::mhc_expand(y, n).shape(), Shape({0, n, D}));
  EXPECT_EQ(ops::mhc_mean_contract(x).shape(), Shape({0, D}));
  EXPECT_EQ(ops::mhc_sinkhorn(gpu(Tensor::zeros({0, n, n}, DType::f32)), 1e-6, 20).numel(), 0);
}

TEST(MhcGpu, BadInputRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const int64_t T = 3, n = 4, D = 8;
  ops::MhcConfig c;
  const Tensor x = gpu(randn({T, n, D}, DType::f32, rng));
  const Tensor pre = gpu(randn({T, n}, DType::f32, rng));
  const Tensor du = gpu(randn({T, D}, DType::f32, rng));
  EXPECT_NO_THROW(ops::mhc_collapse(x, pre));
  // f16 streams: the CPU reads them, CUDA does not.
  testing::expect_error([&] { ops::mhc_collapse(gpu(cpu(x).to(DType::f16)), pre); },
                        "must be f32, f64 or bf16 on CUDA");
  testing::expect_error([&] { ops::mhc_expand(gpu(cpu(du).to(DType::f16)), 2); },
                        "must be f32, f64 or bf16 on CUDA");
  // Mixed devices.
  testing::expect_error([&] { ops::mhc_collapse(x, cpu(pre)); }, "must be on the device of x");
  testing::expect_error(
      [&] {
        ops::mhc_write_back(x, cpu(du), pre, gpu(randn({T, n, n}, DType::f32, rng)));
      },
      "must be on the device of x");
  // Shapes (the device-independent checks hold on CUDA too).
  testing::expect_error(
      [&] {
        ops::mhc_collapse(x, gpu(randn({T, n + 1}, DType::f32, rng)));
      },
      "pre must have shape");
  testing::expect_error(
      [&] {
        ops::mhc_sinkhorn(gpu(randn({T, 3, 4}, DType::f32, rng)), 1e-6, 20);
      },
      "must be [T, n, n]");
  // More than 8 streams: refused where the kernels keep n x n matrices, fine elsewhere.
  const Tensor x9 = gpu(randn({T, 9, D}, DType::f32, rng));
  testing::expect_error(
      [&] {
        ops::mhc_collapse_backward(x9, gpu(randn({T, 9}, DType::f32, rng)), du);
      },
      "at most 8 streams on CUDA");
  testing::expect_error(
      [&] {
        ops::mhc_sinkhorn(gpu(randn({T, 9, 9}, DType::f32, rng)), 1e-6, 20);
      },
      "at most 8 streams on CUDA");
  EXPECT_NO_THROW(ops::mhc_mean_contract(x9));
  EXPECT_NO_THROW(ops::mhc_expand(du, 9));
  // Accumulators: defined, on the device, contiguous.
  const Params2 p = make_params(n, D, DType::f32, rng);
  const ops::MhcMappings m = ops::mhc_mappings_forward(x, p.on(true), c);
  const Grads2 g0 = make_grads(n, D, DType::f32, rng);
  ops::MhcParamGrads g = g0.fresh(true);
  EXPECT_NO_THROW(ops::mhc_mappings_backward(x, p.on(true), c, m, pre, Tensor(), Tensor(), g));
  ops::MhcParamGrads strided = g;
  strided.dfn = gpu(randn({n * D, (2 + n) * n}, DType::f32, rng)).transpose(0, 1);
  testing::expect_error(
      [&] { ops::mhc_mappings_backward(x, p.on(true), c, m, pre, Tensor(), Tensor(), strided); },
      "grads.dfn must be contiguous");
  ops::MhcParamGrads host = g;
  host.dbase = cpu(g.dbase);
  testing::expect_error(
      [&] { ops::mhc_mappings_backward(x, p.on(true), c, m, pre, Tensor(), Tensor(), host); },
      "grads.dbase must be on the device of x");
  ops::MhcParamGrads none = g;
  none.dscale = Tensor();
  testing::expect_error(
      [&] { ops::mhc_mappings_backward(x, p.on(true), c, m, pre, Tensor(), Tensor(), none); },
      "grads.dscale is undefined");
  // Parameters on the host next to CUDA streams.
  ops::MhcParams ph = p.on(true);
  ph.fn = p.fn.h;
  testing::expect_error([&] { ops::mhc_mappings_forward(x, ph, c); },
                        "params.fn must be on the device of x");
}

}  // namespace
}  // namespace hlm
