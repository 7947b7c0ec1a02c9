#include "train/adamw.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <memory>

#include "core/formats.h"
#include "core/safetensors.h"
#include "testing.h"
#include "train/schedule.h"

namespace hlm::train {
namespace {

Param make_param(const std::string& name, Tensor value, bool keep_fp32 = false,
                 bool no_wd = false) {
  Param p;
  p.name = name;
  p.value = std::move(value);
  p.keep_fp32 = keep_fp32;
  p.no_weight_decay = no_wd || keep_fp32;
  p.grad = Tensor::zeros(p.value.shape(), grad_dtype_for(p.value.dtype()));
  return p;
}

// A plain FP64 AdamW in the PyTorch form (step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps),
// written independently of the implementation.
struct RefAdamW {
  double b1, b2, eps, wd;
  std::vector<double> p, m, v;
  int t = 0;
  void step(const std::vector<double>& g, double lr, double clip, bool decay) {
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double gi = g[i] * clip;
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      if (decay) p[i] *= 1 - lr * wd;
      p[i] -= (lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

TEST(AdamW, HandComputedSteps) {
  // One weight w = 1 with a constant gradient 0.5, lr 0.1, beta1 0.9, beta2 0.999, eps tiny:
  // with bias correction m_hat = 0.5 and v_hat = 0.25 at every step, so each step moves by exactly
  // lr (0.1); with weight decay 0.1 the weight is first scaled by 1 - lr * wd = 0.99.
  for (bool wd : {false, true}) {
    Param p = make_param("w", Tensor::from_values({1, 1}, {1.0}, DType::f64));
    AdamWConfig cfg;
    cfg.beta1 = 0.9, cfg.beta2 = 0.999, cfg.eps = 1e-300, cfg.max_grad_norm = 0;
    cfg.weight_decay = wd ? 0.1 : 0.0;
    AdamW opt({{"w", &p}}, cfg);
    const double expect_wd[] = {0.89, 0.7811, 0.673289};
    const double expect_plain[] = {0.9, 0.8, 0.7};
    for (int s = 0; s < 3; ++s) {
      p.grad.fill_(0.5);
      const auto r = opt.step(0.1);
      EXPECT_TRUE(r.applied);
      EXPECT_EQ(r.step, s + 1);
      EXPECT_DOUBLE_EQ(r.grad_norm, 0.5);
      EXPECT_NEAR(p.value.item(), wd ? expect_wd[s] : expect_plain[s], 1e-15) << "step " << s + 1;
    }
    // Moments after 3 steps: m = 0.05 (1 + 0.9 + 0.81), v = 0.00025 (1 + 0.999 + 0.998001).
    EXPECT_NEAR(opt.exp_avg("w").item(), 0.05 * 2.71, 1e-16);
    EXPECT_NEAR(opt.exp_avg_sq("w").item(), 0.00025 * 2.997001, 1e-18);
  }
  // Two steps with gradients 1 then -1, no decay: m_hat = -0.01 / 0.19, v_hat = 0.001999 /
  // 0.001999.
  Param p = make_param("w", Tensor::from_values({2, 1}, {0.0, 2.0}, DType::f64));
  AdamWConfig cfg;
  cfg.beta1 = 0.9, cfg.beta2 = 0.999, cfg.eps = 1e-300, cfg.weight_decay = 0, cfg.max_grad_norm = 0;
  AdamW opt({{"w", &p}}, cfg);
  p.grad.copy_(Tensor::from_values({2, 1}, {1.0, 1.0}, DType::f64));
  opt.step(0.1);
  p.grad.copy_(Tensor::from_values({2, 1}, {-1.0, -1.0}, DType::f64));
  opt.step(0.1);
  const double second = 0.1 * (-0.01 / 0.19);  // v_hat = 1
  EXPECT_NEAR(p.value.at({0, 0}), 0.0 - 0.1 - second, 1e-15);
  EXPECT_NEAR(p.value.at({1, 0}), 2.0 - 0.1 - second, 1e-15);
}

TEST(AdamW, MatchesFp64ReferenceWithDecayAndClipping) {
  Rng rng(testing::test_seed());
  // Two-dimensional (decayed), one-dimensional (not, by rule) and flagged no_weight_decay params.
  std::vector<Param> ps;
  ps.push_back(make_param("a.weight", randn({5, 7}, DType::f64, rng)));
  ps.push_back(make_param("a.bias", randn({7}, DType::f64, rng)));
  ps.push_back(make_param("emb", randn({3, 4}, DType::f64, rng), false, true));
  AdamWConfig cfg;
  cfg.beta1 = 0.8, cfg.beta2 = 0.99, cfg.eps = 1e-6, cfg.weight_decay = 0.3;
  cfg.max_grad_norm = 4.0;
  std::vector<std::pair<std::string, Param*>> list;
  for (auto& p : ps) list.emplace_back(p.name, &p);
  AdamW opt(list, cfg);
  std::vector<RefAdamW> ref;
  for (auto& p : ps) {
    const auto v = p.value.to_f64_vector();
    ref.push_back({cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, v,
                   std::vector<double>(v.size(), 0.0), std::vector<double>(v.size(), 0.0)});
  }
  const bool decays[] = {true, false, false};
  int clipped = 0;
  for (int s = 1; s <= 6; ++s) {
    double sq = 0;
    std::vector<std::vector<double>> gs;
    for (auto& p : ps) {
      // Gradient scales vary so that some steps clip and some do not.
      p.grad = randn(p.value.shape(), DType::f64, rng, s % 2 ? 2.0 : 0.3);
      gs.push_back(p.grad.to_f64_vector());
      for (double g : gs.back()) sq += g * g;
    }
    const double norm = std::sqrt(sq), clip = norm > 4.0 ? 4.0 / norm : 1.0;
    clipped += norm > 4.0;
    const double lr = 0.01 * s;
    const auto r = opt.step(lr);
    EXPECT_NEAR(r.grad_norm, norm, 1e-13 * norm);
    EXPECT_NEAR(r.clip_scale, clip, 1e-14);
    for (size_t i = 0; i < ps.size(); ++i) {
      ref[i].step(gs[i], lr, clip, decays[i]);
      const Tensor want = Tensor::from_values(ps[i].value.shape(), ref[i].p, DType::f64);
      EXPECT_TRUE(testing::close(ps[i].value, want, {1e-14, 1e-14})) << ps[i].name << " step " << s;
      const Tensor want_v = Tensor::from_values(ps[i].value.shape(), ref[i].v, DType::f64);
      EXPECT_TRUE(testing::close(opt.exp_avg_sq(ps[i].name), want_v, {1e-13, 1e-15}));
    }
  }
  EXPECT_GE(clipped, 1);
  EXPECT_LE(clipped, 5);
}

TEST(AdamW, WeightDecayDecisionPerParameter) {
  Param w2 = make_param("w", Tensor::full({2, 3}, 1.5, DType::f64));
  Param b1 = make_param("b", Tensor::full({3}, 1.5, DType::f64));
  Param norm = make_param("norm.weight", Tensor::full({3}, 1.5, DType::f64));
  Param alog = make_param("A_log", Tensor::full({2, 3}, 1.5, DType::f32), true);
  Param flag = make_param("emb", Tensor::full({2, 3}, 1.5, DType::f64), false, true);
  std::vector<std::pair<std::string, Param*>> list{
      {"w", &w2}, {"b", &b1}, {"norm.weight", &norm}, {"A_log", &alog}, {"emb", &flag}};
  AdamWConfig cfg;
  cfg.weight_decay = 0.5;
  AdamW opt(list, cfg);
  EXPECT_TRUE(opt.decision("w").decay);
  EXPECT_STREQ(opt.decision("b").reason, "fewer than 2 dimensions");
  EXPECT_FALSE(opt.decision("norm.weight").decay);
  EXPECT_STREQ(opt.decision("A_log").reason, "keep_fp32");
  EXPECT_STREQ(opt.decision("emb").reason, "no_weight_decay");
  EXPECT_EQ(opt.name(0), "w");
  EXPECT_TRUE(opt.decision(size_t(0)).decay);
  // Zero gradients: Adam's term is 0, so only the decay moves a weight: 1.5 * (1 - 0.1 * 0.5).
  opt.step(0.1);
  EXPECT_EQ(w2.value.at({1, 2}), 1.5 * (1 - 0.05));
  EXPECT_EQ(b1.value.at({0}), 1.5);
  EXPECT_EQ(alog.value.at({0, 0}), 1.5);
  EXPECT_EQ(flag.value.at({0, 0}), 1.5);
  cfg.decay_1d = true;
  AdamW opt1d(list, cfg);
  EXPECT_TRUE(opt1d.decision("b").decay);
  EXPECT_FALSE(opt1d.decision("A_log").decay);
  cfg.weight_decay = 0;
  AdamW opt0(list, cfg);
  for (size_t i = 0; i < opt0.size(); ++i)
    EXPECT_STREQ(opt0.decision(i).reason, "weight_decay is 0");
}

TEST(AdamW, Bf16ParameterFollowsItsFp32Master) {
  Rng rng(testing::test_seed());
  // Same start (bf16-representable) and gradients for a bf16 parameter and an f32 one: the bf16
  // run's master must follow the f32 run bit for bit, and its value is the master rounded to
  // nearest even after every step. lr is far below a bf16 ulp, so the master must carry the
  // updates.
  Tensor init = randn({8, 16}, DType::bf16, rng);
  Param pb = make_param("w", init.clone());
  Param pf = make_param("w", init.to(DType::f32));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  AdamW ob({{"w", &pb}}, cfg), of({{"w", &pf}}, cfg);
  EXPECT_TRUE(testing::bit_equal(ob.master("w"), pf.value));
  for (int s = 0; s < 12; ++s) {
    Tensor g = randn({8, 16}, DType::f32, rng);
    pb.grad.copy_(g);
    pf.grad.copy_(g);
    ob.step(1e-4);
    of.step(1e-4);
    ASSERT_TRUE(testing::bit_equal(ob.master("w"), pf.value)) << "step " << s + 1;
    const float* m = ob.master("w").data<float>();
    const bf16* v = pb.value.data<bf16>();
    for (int64_t i = 0; i < pb.value.numel(); ++i)
      ASSERT_EQ(v[i].bits, float_to_bf16(m[i]).bits) << "element " << i;
  }
  EXPECT_EQ(pb.value.dtype(), DType::bf16);
  EXPECT_EQ(ob.master("w").dtype(), DType::f32);
  // The master moved by ~12 * 1e-4 while most bf16 values could not: they differ somewhere.
  const auto mv = ob.master("w").to_f64_vector(), bv = pb.value.to_f64_vector();
  int64_t differ = 0;
  for (size_t i = 0; i < mv.size(); ++i) differ += mv[i] != bv[i];
  EXPECT_GT(differ, int64_t(mv.size() / 2));
}

TEST(AdamW, F16ParameterIsRoundedFromItsMaster) {
  Rng rng(testing::test_seed());
  Tensor init = randn({5, 6}, DType::f16, rng);
  Param ph = make_param("w", init.clone());
  Param pf = make_param("w", init.to(DType::f32));
  AdamW oh({{"w", &ph}}), of({{"w", &pf}});
  for (int s = 0; s < 4; ++s) {
    Tensor g = randn({5, 6}, DType::f32, rng);
    ph.grad.copy_(g);
    pf.grad.copy_(g);
    oh.step(3e-3);
    of.step(3e-3);
  }
  ASSERT_TRUE(testing::bit_equal(oh.master("w"), pf.value));
  const float* m = oh.master("w").data<float>();
  const f16* v = ph.value.data<f16>();
  for (int64_t i = 0; i < ph.value.numel(); ++i) EXPECT_EQ(v[i].bits, float_to_f16(m[i]).bits);
}

TEST(AdamW, GradNormIsFp64SumInFixedOrder) {
  Rng rng(testing::test_seed());
  // Sizes beyond one norm block (65536) and mixed gradient dtypes.
  Param a = make_param("a", randn({70001}, DType::f32, rng));
  Param b = make_param("b", randn({3, 5}, DType::f64, rng));
  Param c = make_param("c", randn({300, 500}, DType::bf16, rng));
  a.grad = randn({70001}, DType::f32, rng, 0.01);
  b.grad = randn({3, 5}, DType::f64, rng, 3.0);
  c.grad = randn({300, 500}, DType::f32, rng, 0.02);
  AdamWConfig cfg;
  cfg.max_grad_norm = 1.0;
  AdamW opt({{"a", &a}, {"b", &b}, {"c", &c}}, cfg);
  double sq = 0;
  for (const Param* p : {&a, &b, &c})
    for (double g : p->grad.to_f64_vector()) sq += g * g;
  const GradNorm gn = opt.grad_norm();
  EXPECT_TRUE(gn.finite);
  EXPECT_NEAR(gn.norm, std::sqrt(sq), 1e-13 * std::sqrt(sq));
  ASSERT_GT(gn.norm, 1.0);
  EXPECT_DOUBLE_EQ(gn.clip_scale, 1.0 / gn.norm);
  // Independent of the thread count, bit for bit.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const GradNorm one = opt.grad_norm();
  omp_set_num_threads(std::max(2, threads));
  const GradNorm many = opt.grad_norm();
  omp_set_num_threads(threads);
  EXPECT_EQ(one.norm, gn.norm);
  EXPECT_EQ(many.norm, gn.norm);
  // Gradients are not modified by clipping.
  const Tensor before = b.grad.clone();
  opt.step(1e-3);
  EXPECT_TRUE(testing::bit_equal(b.grad, before));
  // Clipping off: the scale stays 1, the norm is still reported.
  cfg.max_grad_norm = 0;
  AdamW off({{"a", &a}, {"b", &b}, {"c", &c}}, cfg);
  EXPECT_EQ(off.grad_norm().clip_scale, 1.0);
  EXPECT_EQ(off.grad_norm().norm, gn.norm);
}

TEST(AdamW, NonFiniteGradNormSkipsTheStep) {
  Rng rng(testing::test_seed());
  for (double bad : {double(NAN), double(INFINITY)}) {
    Param a = make_param("a", randn({4, 4}, DType::bf16, rng));
    Param b = make_param("b", randn({4}, DType::f32, rng));
    AdamW opt({{"a", &a}, {"b", &b}});
    a.grad = randn({4, 4}, DType::f32, rng);
    b.grad = randn({4}, DType::f32, rng);
    opt.step(1e-2);
    const Tensor a0 = a.value.clone(), b0 = b.value.clone(), m0 = opt.exp_avg("a").clone();
    b.grad.copy_(Tensor::from_values({4}, {1.0, bad, 2.0, 3.0}, DType::f64));
    const auto r = opt.step(1e-2);
    EXPECT_FALSE(r.finite);
    EXPECT_FALSE(r.applied);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(r.step, 1);
    EXPECT_EQ(opt.step_count(), 1);
    EXPECT_TRUE(testing::bit_equal(a.value, a0));
    EXPECT_TRUE(testing::bit_equal(b.value, b0));
    EXPECT_TRUE(testing::bit_equal(opt.exp_avg("a"), m0));
  }
}

// A small "model": bf16 matrix, f32 matrix, keep_fp32 vector, f32 bias.
struct Model {
  std::vector<std::unique_ptr<Param>> ps;
  explicit Model(uint64_t seed, bool zero = false) {
    Rng rng(seed);
    auto add = [&](const char* n, Shape s, DType dt, bool keep) {
      Tensor v = zero ? Tensor::zeros(s, dt) : randn(s, dt, rng);
      ps.push_back(std::make_unique<Param>(make_param(n, v, keep)));
    };
    add("layer.w", {6, 10}, DType::bf16, false);
    add("layer.v", {10, 3}, DType::f32, false);
    add("layer.A_log", {6}, DType::f32, true);
    add("layer.bias", {3}, DType::f32, false);
  }
  std::vector<std::pair<std::string, Param*>> list() {
    std::vector<std::pair<std::string, Param*>> l;
    for (auto& p : ps) l.emplace_back(p->name, p.get());
    return l;
  }
  // Gradients that depend on the step and on the current values (as a real loss would).
  void grads(int64_t step) {
    Rng rng(77, uint64_t(step));
    for (auto& p : ps) {
      Tensor noise = randn(p->value.shape(), DType::f64, rng);
      const auto v = p->value.to_f64_vector(), n = noise.to_f64_vector();
      std::vector<double> g(v.size());
      for (size_t i = 0; i < g.size(); ++i) g[i] = 0.5 * v[i] + n[i];
      p->grad.copy_(Tensor::from_values(p->value.shape(), g, DType::f64));
    }
  }
};

TEST(AdamW, SaveLoadContinueIsBitIdentical) {
  const uint64_t seed = testing::test_seed();
  LrSchedule sched({ScheduleKind::cosine, 3e-2, 2, 8, 0.1});
  AdamWConfig cfg;
  cfg.max_grad_norm = 2.0;
  // Uninterrupted run of 8 steps.
  Model full(seed);
  AdamW of(full.list(), cfg);
  for (int64_t s = 1; s <= 8; ++s) {
    full.grads(s);
    ASSERT_TRUE(of.step(sched.at(s)).applied);
  }
  // 4 steps, checkpoint through a safetensors file, a fresh process (new params, new optimizer),
  // load, 4 more steps.
  const std::string path = ::testing::TempDir() + "/train_adamw_resume.safetensors";
  {
    Model first(seed);
    AdamW o1(first.list(), cfg);
    for (int64_t s = 1; s <= 4; ++s) {
      first.grads(s);
      o1.step(sched.at(s));
    }
    safetensors::save(path, o1.state_dict());
  }
  Model resumed(seed + 1, /*zero=*/true);
  AdamW o2(resumed.list(), cfg);
  o2.load_state_dict(safetensors::load(path).tensors);
  EXPECT_EQ(o2.step_count(), 4);
  for (int64_t s = 5; s <= 8; ++s) {
    resumed.grads(s);
    o2.step(sched.at(s));
  }
  EXPECT_EQ(o2.step_count(), 8);
  for (size_t i = 0; i < full.ps.size(); ++i) {
    const std::string& n = full.ps[i]->name;
    EXPECT_TRUE(testing::bit_equal(resumed.ps[i]->value, full.ps[i]->value)) << n;
    EXPECT_TRUE(testing::bit_equal(o2.master(n), of.master(n))) << n;
    EXPECT_TRUE(testing::bit_equal(o2.exp_avg(n), of.exp_avg(n))) << n;
    EXPECT_TRUE(testing::bit_equal(o2.exp_avg_sq(n), of.exp_avg_sq(n))) << n;
  }
  // And the run really moved (the check is not trivially satisfied by untouched params).
  Model start(seed);
  EXPECT_FALSE(testing::bit_equal(start.ps[0]->value, full.ps[0]->value));
}

TEST(AdamW, LoadStateChecksTheParameterSet) {
  Model m(testing::test_seed());
  AdamW opt(m.list());
  m.grads(1);
  opt.step(1e-3);
  const auto good = opt.state_dict();
  EXPECT_EQ(good.size(), 1 + 3 * m.ps.size());
  EXPECT_TRUE(good.count("optimizer.master.layer.w"));
  EXPECT_EQ(good.at("optimizer.master.layer.w").dtype(), DType::f32);
  auto with = [&](auto edit) {
    safetensors::TensorMap s;
    for (auto& [k, t] : good) s[k] = t.clone();
    edit(s);
    Model other(1);
    AdamW o(other.list());
    return testing::error_of([&] { o.load_state_dict(s); });
  };
  EXPECT_EQ(with([](auto&) {}), "(no error)");
  EXPECT_NE(with([](auto& s) {
              s.erase("optimizer.exp_avg.layer.v");
            }).find("'optimizer.exp_avg.layer.v' is missing"),
            std::string::npos);
  EXPECT_NE(with([](auto& s) {
              s["optimizer.master.layer.extra"] = Tensor::zeros({2}, DType::f32);
            }).find("'optimizer.master.layer.extra' does not belong"),
            std::string::npos);
  EXPECT_NE(with([](auto& s) {
              s["optimizer.exp_avg_sq.layer.w"] = Tensor::zeros({6, 9}, DType::f32);
            }).find("has shape [6, 9], parameter 'layer.w' has [6, 10]"),
            std::string::npos);
  EXPECT_NE(with([](auto& s) {
              s["optimizer.master.layer.w"] = Tensor::zeros({6, 10}, DType::bf16);
            }).find("is bf16, parameter 'layer.w' needs f32"),
            std::string::npos);
  EXPECT_NE(with([](auto& s) {
              s["optimizer.exp_avg.layer.bias"].template data<float>()[1] = NAN;
            }).find("'optimizer.exp_avg.layer.bias' holds a non-finite value at flat index 1"),
            std::string::npos);
  EXPECT_NE(
      with([](auto& s) { s["optimizer.exp_avg_sq.layer.bias"].template data<float>()[2] = -1; })
          .find("'optimizer.exp_avg_sq.layer.bias' holds a negative or non-finite value at flat "
                "index 2"),
      std::string::npos);
  EXPECT_NE(with([](auto& s) { s.erase("optimizer.step"); }).find("'optimizer.step' is missing"),
            std::string::npos);
  // Entries outside the prefix (model weights in the same checkpoint) are ignored.
  EXPECT_EQ(with([](auto& s) { s["layer.w"] = Tensor::zeros({1}, DType::f32); }), "(no error)");
  // A rejected state leaves the optimizer as it was.
  Model other(2);
  AdamW o(other.list());
  const Tensor before = other.ps[1]->value.clone();
  auto bad = good;
  bad.erase("optimizer.exp_avg_sq.layer.bias");
  EXPECT_THROW(o.load_state_dict(bad), Error);
  EXPECT_TRUE(testing::bit_equal(other.ps[1]->value, before));
  EXPECT_EQ(o.step_count(), 0);
}

TEST(AdamW, RejectsBadParametersAndGradients) {
  Param p = make_param("w", Tensor::zeros({2, 2}, DType::f32));
  EXPECT_NE(testing::error_of([&] {
              AdamW({{"w", &p}, {"w", &p}});
            }).find("appears twice"),
            std::string::npos);
  Param q = make_param("q", Tensor::zeros({2}, DType::e4m3));
  EXPECT_NE(testing::error_of([&] {
              AdamW({{"q", &q}});
            }).find("must be f64, f32, bf16 or f16"),
            std::string::npos);
  Param k = make_param("k", Tensor::zeros({2}, DType::bf16), true);
  EXPECT_NE(testing::error_of([&] { AdamW({{"k", &k}}); }).find("keep_fp32"), std::string::npos);
  AdamW opt({{"w", &p}});
  p.grad = Tensor();
  EXPECT_NE(testing::error_of([&] { opt.step(1e-3); }).find("'w' has no gradient"),
            std::string::npos);
  p.grad = Tensor::zeros({4}, DType::f32);
  EXPECT_NE(
      testing::error_of([&] { opt.step(1e-3); }).find("has shape [4], the parameter has [2, 2]"),
      std::string::npos);
  p.grad = Tensor::zeros({2, 2}, DType::f32);
  EXPECT_NE(testing::error_of([&] { opt.step(NAN); }).find("lr must be finite"), std::string::npos);
  AdamWConfig bad;
  bad.beta2 = 1.0;
  EXPECT_NE(testing::error_of([&] { AdamW({{"w", &p}}, bad); }).find("beta2"), std::string::npos);
}

}  // namespace
}  // namespace hlm::train
