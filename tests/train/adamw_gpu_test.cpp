// AdamW (train/adamw.h) with its parameters on CUDA against the same optimizer on the CPU: f32,
// bf16 (FP32 master) and f64 parameters, a keep_fp32 vector and a parameter larger than one
// norm block, f32 and f64 gradients, four steps with clipping on and off and weight decay on the
// matrices. Every value, master and moment, the gradient norm and the clip factor must be
// bit-identical to the CPU's (the CUDA update repeats the CPU's FP64 arithmetic without FMA
// contraction). Also: a state saved from CUDA and loaded into a fresh CUDA optimizer continues
// bit-identically; a non-finite gradient changes nothing; f16 on CUDA and gradients on the wrong
// device are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "testing.h"
#include "train/adamw.h"

namespace hlm::train {
namespace {

using testing::cpu;
using testing::gpu;

struct Set {
  std::vector<std::unique_ptr<Param>> params;
  std::vector<std::pair<std::string, Param*>> named() {
    std::vector<std::pair<std::string, Param*>> out;
    for (auto& p : params) out.emplace_back(p->name, p.get());
    return out;
  }
};

// The same parameters (values and gradients) on the CPU or on CUDA.
Set make_set(bool on_gpu) {
  Rng rng(testing::test_seed(), 91);
  Set s;
  auto add = [&](const std::string& name, const Shape& shape, DType dt, DType gdt, bool keep) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->keep_fp32 = keep;
    p->no_weight_decay = keep;
    p->value = randn(shape, DType::f64, rng, 0.5).to(dt);
    p->grad = randn(shape, DType::f64, rng, 2.0).to(gdt);
    if (on_gpu) p->value = gpu(p->value), p->grad = gpu(p->grad);
    s.params.push_back(std::move(p));
  };
  add("w_f32", {37, 19}, DType::f32, DType::f32, false);
  add("w_bf16", {64, 33}, DType::bf16, DType::f32, false);
  add("w_f64", {11, 7}, DType::f64, DType::f64, false);
  add("norm", {96}, DType::f32, DType::f32, true);
  add("big", {AdamW::kNormBlock + 4099}, DType::bf16, DType::f64, false);
  return s;
}

void expect_same(const Tensor& g, const Tensor& c, const std::string& what) {
  EXPECT_TRUE(testing::bit_equal(cpu(g), c)) << what;
}

TEST(AdamWGpu, BitIdenticalToCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (double max_norm : {0.0, 1.0}) {
    SCOPED_TRACE(max_norm);
    AdamWConfig cfg;
    cfg.max_grad_norm = max_norm;
    Set sc = make_set(false), sg = make_set(true);
    AdamW oc(sc.named(), cfg), og(sg.named(), cfg);
    for (int step = 0; step < 4; ++step) {
      const double lr = 1e-3 * (step + 1);
      const StepResult rc = oc.step(lr), rg = og.step(lr);
      EXPECT_EQ(rg.grad_norm, rc.grad_norm);
      EXPECT_EQ(rg.clip_scale, rc.clip_scale);
      EXPECT_TRUE(rg.applied);
      if (max_norm > 0) EXPECT_LT(rg.clip_scale, 1.0);
      for (size_t i = 0; i < sc.params.size(); ++i) {
        const std::string& n = sc.params[i]->name;
        expect_same(sg.params[i]->value, sc.params[i]->value, n + " value");
        expect_same(og.master(n), oc.master(n), n + " master");
        expect_same(og.exp_avg(n), oc.exp_avg(n), n + " m");
        expect_same(og.exp_avg_sq(n), oc.exp_avg_sq(n), n + " v");
      }
    }
  }
}

TEST(AdamWGpu, StateRoundTripContinuesBitIdentically) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Set a = make_set(true), b = make_set(true);
  AdamW oa(a.named());
  oa.step(1e-3);
  oa.step(2e-3);
  const safetensors::TensorMap state = oa.state_dict();
  for (auto& [k, t] : state) EXPECT_TRUE(t.is_cpu()) << k;
  AdamW ob(b.named());
  ob.load_state_dict(state);
  for (size_t i = 0; i < a.params.size(); ++i)
    expect_same(b.params[i]->value, cpu(a.params[i]->value), a.params[i]->name + " loaded value");
  oa.step(3e-3);
  ob.step(3e-3);
  for (size_t i = 0; i < a.params.size(); ++i)
    expect_same(b.params[i]->value, cpu(a.params[i]->value), a.params[i]->name + " next step");
}

TEST(AdamWGpu, NonFiniteGradientChangesNothing) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Set s = make_set(true);
  AdamW o(s.named());
  Tensor g = cpu(s.params[1]->grad);
  g.data<float>()[5] = std::numeric_limits<float>::infinity();
  s.params[1]->grad = gpu(g);
  const Tensor before = cpu(s.params[0]->value);
  const StepResult r = o.step(1e-3);
  EXPECT_FALSE(r.finite);
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(o.step_count(), 0);
  EXPECT_TRUE(testing::bit_equal(cpu(s.params[0]->value), before));
}

TEST(AdamWGpu, BadInputRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 92);
  Param h;
  h.name = "h";
  h.value = gpu(randn({4, 4}, DType::f32, rng).to(DType::f16));
  testing::expect_error([&] { AdamW o({{"h", &h}}); }, "f16 parameter 'h' on CUDA");
  Param p;
  p.name = "p";
  p.value = gpu(randn({4, 4}, DType::f32, rng));
  p.grad = randn({4, 4}, DType::f32, rng);  // on the CPU
  AdamW o({{"p", &p}});
  testing::expect_error([&] { o.step(1e-3); }, "must be on the parameter's device");
}

}  // namespace
}  // namespace hlm::train
