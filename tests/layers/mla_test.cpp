// MLA (layers/dsa/mla.h): the whole forward against a naive FP64 loop written here (projections,
// RMSNorm, RoPE as complex multiplication, causal softmax attention per sequence), gradients
// against central finite differences in FP64, expanded == absorbed, packing, recompute, precision
// policy, bf16 parameters, config validation and bad input.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <complex>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "layers/dsa/mla.h"
#include "testing.h"

namespace hlm {
namespace {

using hlm::testing::cu_of;
using hlm::testing::total;

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::grad_check;
using hlm::testing::test_seed;
using Vec = std::vector<double>;

enum class Variant { nope, rope, yarn, kimi, no_q_lora };
const char* variant_name(Variant v) {
  switch (v) {
    case Variant::nope:
      return "nope";
    case Variant::rope:
      return "rope";
    case Variant::yarn:
      return "yarn";
    case Variant::kimi:
      return "kimi";
    case Variant::no_q_lora:
      return "no_q_lora";
  }
  return "?";
}

// The tiny test shape: D = 16, H = 2, q_lora 8, kv_lora 8, d_nope 4, d_rope 0 or 2, d_v 4.
MlaConfig tiny_config(Variant v, DType dt = DType::f64, MlaForm form = MlaForm::expanded) {
  MlaConfig c;
  c.hidden_size = 16;
  c.num_heads = 2;
  c.q_lora_rank = 8;
  c.kv_lora_rank = 8;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = v == Variant::nope ? 0 : 2;
  c.v_head_dim = 4;
  c.rope_theta = 10.0;  // positions up to ~12: angles of several radians
  c.param_dtype = dt;
  c.form = form;
  if (v == Variant::yarn) {
    c.qk_rope_head_dim = 4;
    YarnConfig y;
    y.factor = 8;
    y.original_max_position_embeddings = 6;
    y.beta_fast = 4;
    y.beta_slow = 1;
    y.mscale = 1.0;
    y.mscale_all_dim = 0.7;
    c.yarn = y;
  }
  if (v == Variant::kimi) c.rope = false;
  if (v == Variant::no_q_lora) c.q_lora_rank = 0;
  return c;
}

PrecisionPolicy native_policy() {
  PrecisionPolicy p;
  p.default_kind = GemmKind::native;
  return p;
}

// Random parameters of unit-ish activations; norm weights 1 + 0.3 N(0, 1).
void randomize(Mla& m, Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    if (name.find("layernorm") != std::string::npos) {
      Tensor t = randn(p->value.shape(), DType::f64, rng, 0.3);
      auto v = t.to_f64_vector();
      for (double& x : v) x += 1.0;
      p->value.copy_(Tensor::from_values(p->value.shape(), v, DType::f64));
    } else {
      rng.fill_normal(p->value, 0.0, 1.0 / std::sqrt(double(p->value.size(1))) * 1.5);
    }
  }
}

// ---- the naive FP64 reference -------------------------------------------------------------------

Vec param(Mla& m, const std::string& name) {
  Param* p = m.find_parameter(name);
  EXPECT_NE(p, nullptr) << name;
  return p->value.to_f64_vector();
}

// y = W x for W [rows, cols] row-major.
Vec matvec(const Vec& W, int64_t rows, int64_t cols, const double* x) {
  Vec y(size_t(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[size_t(r)] += W[size_t(r * cols + c)] * x[c];
  return y;
}

Vec rms(const Vec& x, const Vec& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / double(x.size()) + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
  return y;
}

// RoPE of consecutive pairs as complex numbers: (a + ib) * factor * e^{i pos f_i}.
void rotate(double* v, int64_t d, int64_t pos, const Vec& freq, double factor) {
  for (int64_t i = 0; i < d / 2; ++i) {
    std::complex<double> z(v[2 * i], v[2 * i + 1]);
    z *= factor * std::polar(1.0, double(pos) * freq[size_t(i)]);
    v[2 * i] = z.real(), v[2 * i + 1] = z.imag();
  }
}

Vec naive_mla(Mla& m, const Vec& x, const std::vector<int64_t>& lens) {
  const MlaConfig& c = m.config();
  const int64_t D = c.hidden_size, H = c.num_heads, rq = c.q_lora_rank, rkv = c.kv_lora_rank,
                dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim, dqk = dn + dr;
  const int64_t T = total(lens);
  // Softmax scale and RoPE, from the formulas of docs/dsa.md ("MLA").
  double scale = 1.0 / std::sqrt(double(dqk)), factor = 1.0;
  Vec freq;
  if (c.rope && dr > 0) {
    for (int64_t i = 0; i < dr / 2; ++i) freq.push_back(std::pow(c.rope_theta, -2.0 * i / dr));
    if (c.yarn) {
      freq = c.rope_inv_freq();  // the ramp itself is checked against hand values below
      const double f = c.yarn->factor;
      const double m_all = 0.1 * c.yarn->mscale_all_dim * std::log(f) + 1;
      scale *= m_all * m_all;
      factor = (0.1 * c.yarn->mscale * std::log(f) + 1) / m_all;
    }
  }
  const bool rot = !freq.empty();
  std::vector<Vec> q(static_cast<size_t>(T)), k(static_cast<size_t>(T)), v(static_cast<size_t>(T));
  int64_t t = 0;
  for (int64_t L : lens)
    for (int64_t r = 0; r < L; ++r, ++t) {
      const double* xt = x.data() + t * D;
      Vec qt;
      if (rq > 0) {
        const Vec cq = rms(matvec(param(m, "q_a_proj.weight"), rq, D, xt),
                           param(m, "q_a_layernorm.weight"), c.rms_norm_eps);
        qt = matvec(param(m, "q_b_proj.weight"), H * dqk, rq, cq.data());
      } else {
        qt = matvec(param(m, "q_proj.weight"), H * dqk, D, xt);
      }
      const Vec kva = matvec(param(m, "kv_a_proj_with_mqa.weight"), rkv + dr, D, xt);
      const Vec ckv = rms(Vec(kva.begin(), kva.begin() + rkv), param(m, "kv_a_layernorm.weight"),
                          c.rms_norm_eps);
      Vec kp(kva.begin() + rkv, kva.end());
      if (rot) rotate(kp.data(), dr, r, freq, factor);
      const Vec kvb = matvec(param(m, "kv_b_proj.weight"), H * (dn + dv), rkv, ckv.data());
      Vec kt(size_t(H * dqk)), vt(size_t(H * dv));
      for (int64_t h = 0; h < H; ++h) {
        if (rot) rotate(qt.data() + h * dqk + dn, dr, r, freq, factor);
        for (int64_t i = 0; i < dn; ++i) kt[size_t(h * dqk + i)] = kvb[size_t(h * (dn + dv) + i)];
        for (int64_t i = 0; i < dr; ++i) kt[size_t(h * dqk + dn + i)] = kp[size_t(i)];
        for (int64_t i = 0; i < dv; ++i)
          vt[size_t(h * dv + i)] = kvb[size_t(h * (dn + dv) + dn + i)];
      }
      q[size_t(t)] = qt, k[size_t(t)] = kt, v[size_t(t)] = vt;
    }
  // Causal softmax attention, one sequence at a time.
  Vec o(size_t(T * H * dv), 0.0);
  int64_t start = 0;
  for (int64_t L : lens) {
    for (int64_t i = start; i < start + L; ++i)
      for (int64_t h = 0; h < H; ++h) {
        Vec l;
        double mx = -INFINITY;
        for (int64_t j = start; j <= i; ++j) {
          double s = 0;
          for (int64_t c2 = 0; c2 < dqk; ++c2)
            s += q[size_t(i)][size_t(h * dqk + c2)] * k[size_t(j)][size_t(h * dqk + c2)];
          l.push_back(scale * s);
          mx = std::max(mx, scale * s);
        }
        double z = 0;
        for (double a : l) z += std::exp(a - mx);
        for (int64_t j = start; j <= i; ++j)
          for (int64_t c2 = 0; c2 < dv; ++c2)
            o[size_t((i * H + h) * dv + c2)] +=
                std::exp(l[size_t(j - start)] - mx) / z * v[size_t(j)][size_t(h * dv + c2)];
      }
    start += L;
  }
  Vec y(size_t(T * D));
  const Vec wo = param(m, "o_proj.weight");
  for (int64_t i = 0; i < T; ++i) {
    const Vec yi = matvec(wo, D, H * dv, o.data() + i * H * dv);
    std::copy(yi.begin(), yi.end(), y.begin() + i * D);
  }
  return y;
}

// ---- helpers ------------------------------------------------------------------------------------

struct Grads {
  Tensor dx;
  std::vector<std::pair<std::string, Tensor>> params;
};

Grads run_backward(Mla& m, const Tensor& x, const Tensor& cu, const Tensor& dy,
                   Context ctx = Context{}, Tensor* y_out = nullptr) {
  m.zero_grad();
  Mla::Saved s;
  const Tensor y = m.forward(ctx, x, cu, &s);
  if (y_out) *y_out = y;
  Grads g;
  g.dx = m.backward(ctx, dy, s);
  for (auto& [name, p] : m.named_parameters()) g.params.emplace_back(name, p->grad.clone());
  return g;
}

const std::vector<int64_t> kLens{7, 1, 0, 12};  // T = 20, a 1-token and an empty sequence

// One OpenMP thread for the duration of a test (restored on exit). These shapes are tiny: a
// parallel region costs more than it saves, far more when the 2 CI cores are shared, and finite
// differences run thousands of forwards. The packed == documents tests keep the default thread
// count, so the layers also run multi-threaded here; the ops' own tests check thread-count
// independence.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

// ---- tests --------------------------------------------------------------------------------------

TEST(MlaConfig, ValidationNamesTheField) {
  const OneThread one_thread;
  auto expect_error = [](const std::function<void(MlaConfig&)>& edit, const std::string& field) {
    MlaConfig c = tiny_config(Variant::rope);
    edit(c);
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
    EXPECT_THROW(Mla(c, native_policy()), Error) << field;
  };
  expect_error([](MlaConfig& c) { c.hidden_size = 0; }, "hidden_size");
  expect_error([](MlaConfig& c) { c.num_heads = -1; }, "num_heads");
  expect_error([](MlaConfig& c) { c.q_lora_rank = -2; }, "q_lora_rank");
  expect_error([](MlaConfig& c) { c.kv_lora_rank = 0; }, "kv_lora_rank");
  expect_error([](MlaConfig& c) { c.qk_nope_head_dim = 0; }, "qk_nope_head_dim");
  expect_error([](MlaConfig& c) { c.qk_rope_head_dim = 3; }, "qk_rope_head_dim");
  expect_error([](MlaConfig& c) { c.v_head_dim = 0; }, "v_head_dim");
  expect_error([](MlaConfig& c) { c.rms_norm_eps = 0; }, "rms_norm_eps");
  expect_error([](MlaConfig& c) { c.rope_theta = 0.5; }, "rope_theta");
  expect_error([](MlaConfig& c) { c.softmax_scale = -1; }, "softmax_scale");
  expect_error([](MlaConfig& c) { c.param_dtype = DType::i32; }, "param_dtype");
  expect_error([](MlaConfig& c) { c.init_std = NAN; }, "init_std");
  expect_error([](MlaConfig& c) { c.yarn = YarnConfig{0.5}; }, "yarn.factor");
  expect_error(
      [](MlaConfig& c) {
        c.rope = false;
        c.yarn = YarnConfig{};
      },
      "yarn");
  // odd rope dims are fine when nothing is rotated (Kimi-style pe channels)
  MlaConfig ok = tiny_config(Variant::kimi);
  ok.qk_rope_head_dim = 3;
  EXPECT_NO_THROW(ok.validate());
}

TEST(MlaConfig, SoftmaxScaleAndYarnFrequencies) {
  const OneThread one_thread;
  MlaConfig c;
  c.hidden_size = 4096, c.num_heads = 64, c.q_lora_rank = 1536, c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 256, c.qk_rope_head_dim = 0, c.v_head_dim = 256;
  EXPECT_DOUBLE_EQ(c.softmax_scale_value(), 1.0 / 16);  // GLM-5.3-Flash, NoPE: d_n^-1/2
  EXPECT_TRUE(c.rope_inv_freq().empty());
  c.qk_nope_head_dim = 192, c.qk_rope_head_dim = 64;  // GLM-5: (192 + 64)^-1/2
  EXPECT_DOUBLE_EQ(c.softmax_scale_value(), 1.0 / 16);
  c.qk_nope_head_dim = 128, c.rope = false;  // Kimi-Linear: (128 + 64)^-1/2, pe not rotated
  EXPECT_DOUBLE_EQ(c.softmax_scale_value(), 1.0 / std::sqrt(192.0));
  EXPECT_TRUE(c.rope_inv_freq().empty());
  // DeepSeek-V3.2: YaRN factor 40, mscale_all_dim 1: m = 0.1 ln 40 + 1, scale *= m^2 ~ 1.874.
  c.rope = true;
  YarnConfig y;
  y.factor = 40, y.mscale = 1, y.mscale_all_dim = 1;
  c.yarn = y;
  const double m = 0.1 * std::log(40.0) + 1;
  EXPECT_NEAR(m * m, 1.8738, 1e-4);
  EXPECT_DOUBLE_EQ(c.softmax_scale_value(), m * m / std::sqrt(192.0));
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 1.0);  // mscale == mscale_all_dim
  c.softmax_scale = 0.125;
  EXPECT_EQ(c.softmax_scale_value(), 0.125);

  // The YaRN ramp by hand: d_r = 8, theta = 1e4, L_orig = 64, factor 4, beta 32 / 1:
  // corr(32) = 8 ln(64 / 64pi) / (2 ln 1e4) = -0.497 -> low = 0;
  // corr(1) = 8 ln(64 / 2pi) / (2 ln 1e4) = 1.008 -> high = 2; ramp = (0, 1/2, 1, 1).
  MlaConfig r = tiny_config(Variant::rope);
  r.qk_rope_head_dim = 8, r.rope_theta = 1e4;
  YarnConfig y2;
  y2.factor = 4, y2.original_max_position_embeddings = 64;
  r.yarn = y2;
  const Vec f = r.rope_inv_freq();
  ASSERT_EQ(f.size(), 4u);
  EXPECT_NEAR(f[0], 1.0, 1e-15);
  EXPECT_NEAR(f[1], 0.1 * (0.5 + 0.5 / 4), 1e-15);
  EXPECT_NEAR(f[2], 0.01 / 4, 1e-16);
  EXPECT_NEAR(f[3], 0.001 / 4, 1e-17);
  // Without YaRN: theta^(-2i/d).
  r.yarn.reset();
  const Vec f0 = r.rope_inv_freq();
  EXPECT_NEAR(f0[1], 0.1, 1e-15);
  EXPECT_NEAR(f0[3], 0.001, 1e-17);
  // Attention factor m(f, mscale) / m(f, mscale_all_dim).
  r.yarn = YarnConfig{4, 64, 32, 1, 1.0, 0.5};
  EXPECT_DOUBLE_EQ(r.rope_attention_factor(),
                   (0.1 * std::log(4.0) + 1) / (0.05 * std::log(4.0) + 1));
  EXPECT_DOUBLE_EQ(yarn_get_mscale(1.0, 3.0), 1.0);
}

TEST(Mla, ParameterNamesAndShapes) {
  const OneThread one_thread;
  Mla m(tiny_config(Variant::rope), native_policy(), "model.layers.3.self_attn");
  std::vector<std::pair<std::string, Shape>> expected{
      {"q_a_layernorm.weight", {8}},
      {"kv_a_layernorm.weight", {8}},
      {"q_a_proj.weight", {8, 16}},
      {"q_b_proj.weight", {2 * 6, 8}},
      {"kv_a_proj_with_mqa.weight", {8 + 2, 16}},
      {"kv_b_proj.weight", {2 * (4 + 4), 8}},
      {"o_proj.weight", {16, 2 * 4}},
  };
  const auto params = m.named_parameters();
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].first, expected[i].first);
    EXPECT_EQ(params[i].second->value.shape(), expected[i].second) << params[i].first;
  }
  Mla k(tiny_config(Variant::no_q_lora), native_policy());
  EXPECT_NE(k.find_parameter("q_proj.weight"), nullptr);
  EXPECT_EQ(k.find_parameter("q_proj.weight")->value.shape(), (Shape{12, 16}));
  EXPECT_EQ(k.find_parameter("q_a_proj.weight"), nullptr);
  EXPECT_EQ(k.find_parameter("q_a_layernorm.weight"), nullptr);
  // NoPE: kv_a has no rope tail.
  Mla n(tiny_config(Variant::nope), native_policy());
  EXPECT_EQ(n.find_parameter("kv_a_proj_with_mqa.weight")->value.shape(), (Shape{8, 16}));
  EXPECT_EQ(n.find_parameter("q_b_proj.weight")->value.shape(), (Shape{8, 8}));
}

TEST(Mla, InitIsDeterministic) {
  const OneThread one_thread;
  MlaConfig c = tiny_config(Variant::rope, DType::f32);
  c.init_std = 0.5;
  Mla a(c, native_policy()), b(c, native_policy()), d(c, native_policy());
  a.init_weights(7), b.init_weights(7), d.init_weights(8);
  for (auto& [name, p] : a.named_parameters()) {
    EXPECT_TRUE(bit_equal(p->value, b.find_parameter(name)->value)) << name;
    const auto v = p->value.to_f64_vector();
    if (name.find("layernorm") != std::string::npos) {
      for (double x : v) EXPECT_EQ(x, 1.0);
      continue;
    }
    EXPECT_FALSE(bit_equal(p->value, d.find_parameter(name)->value)) << name;
    double ss = 0;
    for (double x : v) ss += x * x;
    EXPECT_NEAR(std::sqrt(ss / double(v.size())), 0.5, 0.15) << name;
  }
  // different parameters get different streams
  EXPECT_NE(a.find_parameter("q_a_proj.weight")->value.to_f64_vector()[0],
            a.find_parameter("kv_a_proj_with_mqa.weight")->value.to_f64_vector()[0]);
}

TEST(Mla, ForwardMatchesNaiveFp64) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const Tensor cu = cu_of(kLens);
  const int64_t T = total(kLens);
  for (Variant v : {Variant::nope, Variant::rope, Variant::yarn, Variant::kimi, Variant::no_q_lora})
    for (MlaForm form : {MlaForm::expanded, MlaForm::absorbed})
      for (DType dt : {DType::f64, DType::f32}) {
        SCOPED_TRACE(fmt::format("{} {} {}", variant_name(v),
                                 form == MlaForm::expanded ? "expanded" : "absorbed",
                                 dtype_name(dt)));
        Mla m(tiny_config(v, dt, form), native_policy());
        randomize(m, rng);
        const Tensor x = randn({T, 16}, dt, rng);
        const Tensor y = m.forward(Context{false}, x, cu, nullptr);
        ASSERT_EQ(y.dtype(), dt);
        const Tensor ref =
            Tensor::from_values({T, 16}, naive_mla(m, x.to_f64_vector(), kLens), DType::f64);
        EXPECT_TRUE(close(y, ref, testing::tolerance_for(dt)));
      }
}

TEST(Mla, GradientsMatchFiniteDifferences) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{6, 1, 9};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  for (Variant v : {Variant::nope, Variant::rope, Variant::yarn, Variant::kimi, Variant::no_q_lora})
    for (MlaForm form : {MlaForm::expanded, MlaForm::absorbed}) {
      SCOPED_TRACE(fmt::format("{} {}", variant_name(v),
                               form == MlaForm::expanded ? "expanded" : "absorbed"));
      Mla m(tiny_config(v, DType::f64, form), native_policy());
      randomize(m, rng);
      Tensor x = randn({T, 16}, DType::f64, rng);
      const Tensor probe = randn({T, 16}, DType::f64, rng);
      const Grads g = run_backward(m, x, cu, probe);
      auto loss = [&] { return testing::dot(m.forward(Context{false}, x, cu, nullptr), probe); };
      EXPECT_TRUE(grad_check(loss, x, g.dx, 1e-6, 1e-7, 48)) << "dx";
      for (auto& [name, gp] : g.params)
        EXPECT_TRUE(grad_check(loss, m.find_parameter(name)->value, gp, 1e-6, 1e-7, 48)) << name;
    }
}

TEST(Mla, ExpandedEqualsAbsorbed) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const Tensor cu = cu_of(kLens);
  const int64_t T = total(kLens);
  for (Variant v :
       {Variant::nope, Variant::rope, Variant::yarn, Variant::kimi, Variant::no_q_lora}) {
    SCOPED_TRACE(variant_name(v));
    Mla m(tiny_config(v), native_policy());
    randomize(m, rng);
    const Tensor x = randn({T, 16}, DType::f64, rng), dy = randn({T, 16}, DType::f64, rng);
    Tensor ye, ya;
    m.set_form(MlaForm::expanded);
    const Grads ge = run_backward(m, x, cu, dy, Context{}, &ye);
    m.set_form(MlaForm::absorbed);
    const Grads ga = run_backward(m, x, cu, dy, Context{}, &ya);
    const testing::Tolerance tol{1e-12, 1e-12};
    EXPECT_TRUE(close(ya, ye, tol)) << "y";
    EXPECT_TRUE(close(ga.dx, ge.dx, tol)) << "dx";
    for (size_t i = 0; i < ge.params.size(); ++i)
      EXPECT_TRUE(close(ga.params[i].second, ge.params[i].second, tol)) << ge.params[i].first;
  }
}

TEST(Mla, PackedEqualsSequencesBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{5, 1, 9, 4};
  const int64_t T = total(lens);
  for (MlaForm form : {MlaForm::expanded, MlaForm::absorbed})
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(fmt::format("{} {}", form == MlaForm::expanded ? "expanded" : "absorbed",
                               dtype_name(dt)));
      Mla m(tiny_config(Variant::rope, dt, form), native_policy());
      randomize(m, rng);
      const Tensor x = randn({T, 16}, dt, rng), dy = randn({T, 16}, dt, rng);
      Tensor y;
      const Grads g = run_backward(m, x, cu_of(lens), dy, Context{}, &y);
      std::vector<Tensor> sums;
      for (auto& [n, t] : g.params) sums.push_back(Tensor::zeros(t.shape(), DType::f64));
      int64_t s0 = 0;
      for (int64_t L : lens) {
        const Tensor xs = x.slice(0, s0, s0 + L).contiguous();
        Tensor ys;
        const Grads gs =
            run_backward(m, xs, cu_of({L}), dy.slice(0, s0, s0 + L).contiguous(), Context{}, &ys);
        EXPECT_TRUE(bit_equal(ys, y.slice(0, s0, s0 + L).contiguous())) << "y, seq at " << s0;
        EXPECT_TRUE(bit_equal(gs.dx, g.dx.slice(0, s0, s0 + L).contiguous()))
            << "dx, seq at " << s0;
        for (size_t i = 0; i < sums.size(); ++i) {
          auto a = sums[i].to_f64_vector();
          const auto b = gs.params[i].second.to_f64_vector();
          for (size_t j = 0; j < a.size(); ++j) a[j] += b[j];
          sums[i] = Tensor::from_values(sums[i].shape(), a, DType::f64);
        }
        s0 += L;
      }
      // Parameter gradients sum over tokens: equal up to the order of that sum.
      for (size_t i = 0; i < sums.size(); ++i)
        EXPECT_TRUE(close(g.params[i].second, sums[i], testing::tolerance_for(dt)))
            << g.params[i].first;
    }
}

TEST(Mla, RecomputeAndAccumulation) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const Tensor cu = cu_of(kLens);
  const int64_t T = total(kLens);
  for (MlaForm form : {MlaForm::expanded, MlaForm::absorbed}) {
    Mla m(tiny_config(Variant::yarn, DType::f32, form), native_policy());
    randomize(m, rng);
    const Tensor x = randn({T, 16}, DType::f32, rng), dy = randn({T, 16}, DType::f32, rng);
    const Grads g = run_backward(m, x, cu, dy);
    Context rc;
    rc.recompute = true;
    Mla::Saved s;
    m.zero_grad();
    m.forward(rc, x, cu, &s);
    EXPECT_FALSE(s.full);
    EXPECT_FALSE(s.p.q.defined());  // only the input is kept
    const Tensor dx = m.backward(rc, dy, s);
    EXPECT_TRUE(bit_equal(dx, g.dx));
    for (auto& [name, t] : g.params)
      EXPECT_TRUE(bit_equal(m.find_parameter(name)->grad, t)) << name;
    // A second backward accumulates: grad = 2 g (exactly for the GEMM-accumulated weights;
    // the RMSNorm weights add their rows one by one into the gradient, so to f32 rounding).
    m.backward(rc, dy, s);
    for (auto& [name, t] : g.params) {
      const Tensor twice = Tensor::from_values(
          t.shape(),
          [&] {
            auto v = t.to_f64_vector();
            for (double& e : v) e *= 2;
            return v;
          }(),
          DType::f64);
      EXPECT_TRUE(close(m.find_parameter(name)->grad, twice, testing::tolerance_for(DType::f32)))
          << name;
    }
  }
}

TEST(Mla, Bf16Parameters) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const Tensor cu = cu_of(kLens);
  const int64_t T = total(kLens);
  for (GemmKind kind : {GemmKind::native, GemmKind::bf16}) {
    PrecisionPolicy pol;
    pol.default_kind = kind;
    Mla m(tiny_config(Variant::rope, DType::bf16, MlaForm::absorbed), pol);
    randomize(m, rng);
    for (auto& [name, p] : m.named_parameters()) ASSERT_EQ(p->value.dtype(), DType::bf16);
    const Tensor x = randn({T, 16}, DType::bf16, rng);
    const Tensor dy = randn({T, 16}, DType::f32, rng);
    Tensor y;
    const Grads g = run_backward(m, x, cu, dy, Context{}, &y);
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_EQ(g.dx.dtype(), DType::bf16);
    for (auto& [name, t] : g.params) EXPECT_EQ(t.dtype(), DType::f32) << name;
    // The same bf16 values in FP64 (exactly representable): computed in f32, rounded once to
    // bf16 at the output.
    const Tensor y32 = m.forward(Context{false}, x.to(DType::f32), cu, nullptr);
    EXPECT_EQ(y32.dtype(), DType::f32);
    const Tensor ref =
        Tensor::from_values({T, 16}, naive_mla(m, x.to_f64_vector(), kLens), DType::f64);
    if (kind == GemmKind::native) {
      EXPECT_TRUE(close(y32, ref, testing::tolerance_for(DType::f32)));
    } else {
      // bf16 GEMM operands and bf16 attention operands (Mla::attention_operand: q_abs, the latent
      // rows, o_lat): about twice the roundings of one bf16 op, so 1.5x its relative tolerance.
      const testing::Tolerance bf = testing::tolerance_for(DType::bf16);
      EXPECT_TRUE(close(y32, ref, {1.5 * bf.rel_l2, bf.max_abs}));
      EXPECT_FALSE(close(y32, ref, testing::tolerance_for(DType::f32)));  // really bf16 GEMMs
    }
    // bf16 x gives bf16 y: the f32 result rounded once.
    EXPECT_TRUE(bit_equal(y, y32.to(DType::bf16)));
  }
}

TEST(Mla, PrecisionPolicyMlaProjDisableQuantization) {
  const OneThread one_thread;
  const char* names[] = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::fp8_block;
  pol.grad_format = Fp8Format::e5m2;
  const std::string path = "model.layers.3.self_attn";
  {
    Mla m(tiny_config(Variant::rope), pol, path);
    for (const char* n : names)
      EXPECT_EQ(m.find_parameter(std::string(n) + ".weight") != nullptr, true);
    EXPECT_EQ(m.q_a_proj().precision(), (GemmPrecision{GemmKind::fp8_block, Fp8Format::e5m2}));
    EXPECT_EQ(m.q_b_proj().precision().kind, GemmKind::fp8_block);
    EXPECT_EQ(m.kv_a_proj_with_mqa().precision().kind, GemmKind::fp8_block);
    EXPECT_EQ(m.kv_b_proj().precision().kind, GemmKind::fp8_block);
    EXPECT_EQ(m.o_proj().precision().kind, GemmKind::fp8_block);
  }
  pol.mla_proj_disable_quantization = true;
  {
    Mla m(tiny_config(Variant::rope), pol, path);
    for (Linear* l :
         {&m.q_a_proj(), &m.q_b_proj(), &m.kv_a_proj_with_mqa(), &m.kv_b_proj(), &m.o_proj()})
      EXPECT_EQ(l->precision().kind, GemmKind::bf16);
    Mla k(tiny_config(Variant::no_q_lora), pol, path);
    EXPECT_EQ(k.q_proj().precision().kind, GemmKind::bf16);
  }
  // modules_to_not_convert matches by full path.
  pol.mla_proj_disable_quantization = false;
  pol.modules_to_not_convert = {"model.layers.3.self_attn.kv_b_proj"};
  {
    Mla m(tiny_config(Variant::rope), pol, path);
    EXPECT_EQ(m.kv_b_proj().precision().kind, GemmKind::bf16);
    EXPECT_EQ(m.q_b_proj().precision().kind, GemmKind::fp8_block);
    Mla other(tiny_config(Variant::rope), pol, "model.layers.7.self_attn");
    EXPECT_EQ(other.kv_b_proj().precision().kind, GemmKind::fp8_block);
  }
}

TEST(Mla, Fp8ForwardAndBackwardRun) {
  const OneThread one_thread;
  // The FP8 path end to end (the Linear emulation is tested bit-exactly in linear_test): close to
  // the exact result at FP8 accuracy, and both forms agree to that accuracy too.
  Rng rng(test_seed());
  const Tensor cu = cu_of(kLens);
  const int64_t T = total(kLens);
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::fp8_block;
  Mla m(tiny_config(Variant::rope, DType::f32, MlaForm::expanded), pol);
  randomize(m, rng);
  const Tensor x = randn({T, 16}, DType::f32, rng), dy = randn({T, 16}, DType::f32, rng);
  Tensor y;
  const Grads g = run_backward(m, x, cu, dy, Context{}, &y);
  const Tensor ref =
      Tensor::from_values({T, 16}, naive_mla(m, x.to_f64_vector(), kLens), DType::f64);
  const testing::ErrorStats st = testing::compare(y, ref);
  EXPECT_LT(st.rel_l2, 0.1) << st.report(y);
  EXPECT_GT(st.rel_l2, 1e-4) << "fp8 should not be exact";
  for (auto& [name, t] : g.params) {
    double n = 0;
    for (double v : t.to_f64_vector()) {
      n += v * v;
      EXPECT_TRUE(std::isfinite(v)) << name;
    }
    EXPECT_GT(n, 0) << name;
  }
  m.set_form(MlaForm::absorbed);
  const Tensor ya = m.forward(Context{false}, x, cu, nullptr);
  EXPECT_LT(testing::compare(ya, ref).rel_l2, 0.1);
}

TEST(Mla, BadInput) {
  const OneThread one_thread;
  Rng rng(test_seed());
  Mla m(tiny_config(Variant::rope), native_policy());
  randomize(m, rng);
  const Tensor x = randn({20, 16}, DType::f64, rng);
  auto expect_error = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error, expected one mentioning '" << what << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const Context ctx;
  Mla::Saved s;
  expect_error(
      [&] {
        m.forward(ctx, randn({20, 15}, DType::f64, rng), cu_of({20}), &s);
      },
      "hidden_size");
  expect_error(
      [&] {
        m.forward(ctx, Tensor::zeros({20, 16}, DType::i32), cu_of({20}), &s);
      },
      "f64, f32 or bf16");
  expect_error(
      [&] {
        m.forward(ctx, Tensor::zeros({0, 16}, DType::f64), cu_of({}), &s);
      },
      "no tokens");
  expect_error([&] { m.forward(ctx, x, cu_of({10, 9}), &s); }, "cu_seqlens");
  expect_error(
      [&] {
        m.forward(ctx, x, Tensor::from_vector<int64_t>({3}, {0, 12, 20}).slice(0, 0, 2), &s);
      },
      "cu_seqlens");
  expect_error(
      [&] {
        m.forward(ctx, x, Tensor::from_vector<int64_t>({3}, {0, 12, 8}), &s);
      },
      "cu_seqlens");
  expect_error([&] { m.backward(ctx, x, Mla::Saved{}); }, "Saved is empty");
  m.forward(ctx, x, cu_of({20}), &s);
  expect_error([&] { m.backward(ctx, randn({19, 16}, DType::f64, rng), s); }, "dy");
  expect_error([&] { m.absorb_query(randn({20, 2, 5}, DType::f64, rng)); }, "q");
  expect_error([&] { m.output(ctx, randn({20, 3, 8}, DType::f64, rng), nullptr); }, "o_lat");
  expect_error(
      [&] {
        m.project_backward(ctx, randn({20, 2, 6}, DType::f64, rng), randn({20, 9}, DType::f64, rng),
                           s.proj);
      },
      "dkv");
  expect_error(
      [&] {
        m.output_backward(ctx, randn({20, 16}, DType::f64, rng), Mla::OutSaved{});
      },
      "OutSaved is empty");
}

}  // namespace
}  // namespace hlm
