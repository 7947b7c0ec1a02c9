// MoeLayer (layers/moe/moe_layer.h): parameter names and keep-in-FP32, agreement with the ops/moe.h
// pipeline, central finite differences of every parameter and of x (aux loss included, with the
// selection checked unchanged under every probe), routing replay, packing, recompute, the expert
// GEMM precision against per-expert Linear layers, the bias update, bf16 and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "layers/moe/moe_layer.h"
#include "ops/gemm.h"
#include "testing.h"

namespace hlm {
namespace {

using hlm::testing::expect_error;

using testing::bit_equal;
using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;

MoeConfig moe_cfg(int64_t D, int64_t E, int64_t K, int64_t I, int64_t n_shared, DType dt,
                  uint64_t seed) {
  MoeConfig c;
  c.hidden_size = D;
  c.n_experts = E;
  c.top_k = K;
  c.moe_intermediate_size = I;
  c.n_shared_experts = n_shared;
  c.dtype = dt;
  c.seed = seed;
  c.init_std = 0.5;
  return c;
}

PrecisionPolicy policy(GemmKind k) {
  PrecisionPolicy p;
  p.default_kind = k;
  return p;
}

Tensor sl(const Tensor& t, int64_t a, int64_t b) {
  return t.slice(0, a, b).contiguous();
}

TEST(MoeLayer, ParameterNamesShapesAndKeepFp32) {
  MoeLayer m(moe_cfg(8, 6, 2, 4, 1, DType::f32, 5), policy(GemmKind::native), "model.layers.3.mlp");
  const auto ps = m.named_parameters();
  const std::vector<std::pair<std::string, Shape>> want{
      {"experts.gate_up_proj", {6, 8, 8}},
      {"experts.down_proj", {6, 8, 4}},
      {"gate.weight", {6, 8}},
      {"gate.e_score_correction_bias", {6}},
      {"shared_experts.gate_proj.weight", {4, 8}},
      {"shared_experts.up_proj.weight", {4, 8}},
      {"shared_experts.down_proj.weight", {8, 4}}};
  ASSERT_EQ(ps.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(ps[i].first, want[i].first);
    EXPECT_EQ(ps[i].second->value.shape(), want[i].second) << want[i].first;
  }
  Param* w = m.find_parameter("gate.weight");
  Param* b = m.find_parameter("gate.e_score_correction_bias");
  EXPECT_TRUE(w->keep_fp32);
  EXPECT_FALSE(w->no_weight_decay);
  EXPECT_TRUE(b->keep_fp32 && b->no_weight_decay);
  EXPECT_TRUE(is_keep_fp32_name("model.layers.3.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(bit_equal(b->value, Tensor::zeros({6}, DType::f32)));
  EXPECT_FALSE(m.find_parameter("experts.gate_up_proj")->keep_fp32);
  m.to_dtype(DType::bf16);
  for (auto& [n, p] : m.named_parameters())
    EXPECT_EQ(p->value.dtype(), n.rfind("gate.", 0) == 0 ? DType::f32 : DType::bf16) << n;
  // no shared expert
  MoeLayer r(moe_cfg(8, 6, 2, 4, 0, DType::f32, 5), policy(GemmKind::native), "m");
  EXPECT_EQ(r.named_parameters().size(), 4u);
  EXPECT_EQ(r.shared_experts(), nullptr);
  // deterministic init; every weight its own stream
  MoeLayer a(moe_cfg(8, 6, 2, 4, 1, DType::f32, 5), policy(GemmKind::native), "model.layers.3.mlp");
  MoeLayer c(moe_cfg(8, 6, 2, 4, 1, DType::f32, 6), policy(GemmKind::native), "model.layers.3.mlp");
  MoeLayer a2(moe_cfg(8, 6, 2, 4, 1, DType::f32, 5), policy(GemmKind::native),
              "model.layers.3.mlp");
  EXPECT_TRUE(bit_equal(a.experts_down().value, a2.experts_down().value));
  EXPECT_FALSE(bit_equal(a.experts_down().value, c.experts_down().value));
  // precisions
  PrecisionPolicy f = policy(GemmKind::fp8_block);
  MoeLayer q(moe_cfg(8, 6, 2, 4, 1, DType::f32, 5), f, "model.layers.3.mlp");
  EXPECT_EQ(q.expert_precision().kind, GemmKind::fp8_block);
  EXPECT_EQ(q.router().precision().kind, GemmKind::native);
  EXPECT_EQ(q.shared_experts()->gate_proj().precision().kind, GemmKind::fp8_block);
  f.modules_to_not_convert = {"model.layers.3.mlp.experts"};
  MoeLayer q2(moe_cfg(8, 6, 2, 4, 1, DType::f32, 5), f, "model.layers.3.mlp");
  EXPECT_EQ(q2.expert_precision().kind, GemmKind::bf16);
  EXPECT_EQ(q2.shared_experts()->down_proj().precision().kind, GemmKind::fp8_block);
}

// The ops/moe.h pipeline on the layer's parameters.
struct OpsRef {
  Tensor logits, y, dx;
  ops::MoeRouterResult route;
  ops::MoeWeightGrads g;
  Tensor dgate;
};
OpsRef ops_pipeline(MoeLayer& m, const Tensor& x, const Tensor& G) {
  const MoeConfig& c = m.config();
  const DType dt = x.dtype();
  OpsRef r;
  r.logits = ops::matmul(x, false, m.router().weight().value.to(dt), true);
  r.route = ops::moe_router_forward(r.logits, m.correction_bias().value, c.router_config());
  ops::MoeWeights w{m.experts_gate_up().value, m.experts_down().value, {}, {}};
  const int64_t Is = c.moe_intermediate_size * c.n_shared_experts;
  if (m.shared_experts()) {
    w.shared_gate_up = Tensor::empty({2 * Is, c.hidden_size}, dt);
    w.shared_gate_up.slice(0, 0, Is).copy_(m.shared_experts()->gate_proj().weight().value);
    w.shared_gate_up.slice(0, Is, 2 * Is).copy_(m.shared_experts()->up_proj().weight().value);
    w.shared_down = m.shared_experts()->down_proj().weight().value;
  }
  ops::MoeSaved s;
  r.y = ops::moe_experts_forward(x, w, r.route.topk_idx, r.route.topk_weight, c.swiglu_limit, s);
  r.g = {Tensor::zeros(w.gate_up.shape(), dt), Tensor::zeros(w.down.shape(), dt),
         w.shared_gate_up.defined() ? Tensor::zeros(w.shared_gate_up.shape(), dt) : Tensor(),
         w.shared_down.defined() ? Tensor::zeros(w.shared_down.shape(), dt) : Tensor()};
  const ops::MoeGrads eg = ops::moe_experts_backward(s, w, G, r.g);
  const Tensor dl = ops::moe_router_backward(r.logits, r.route, c.router_config(), eg.dtopk_weight);
  r.dgate = ops::matmul(dl, true, x, false);
  const Tensor dxr = ops::matmul(dl, false, m.router().weight().value.to(dt), false);
  std::vector<double> a = eg.dx.to_f64_vector();
  const std::vector<double> b = dxr.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  r.dx = Tensor::from_values(x.shape(), a, DType::f64);
  return r;
}

TEST(MoeLayer, MatchesTheOpsPipeline) {
  Rng rng(test_seed());
  for (DType dt : {DType::f64, DType::f32}) {
    for (int64_t shared : {1, 0}) {
      MoeConfig c = moe_cfg(10, 6, 2, 5, shared, dt, test_seed());
      c.swiglu_limit = 2.0;
      MoeLayer m(c, policy(GemmKind::native), "mlp");
      rng.fill_normal(m.correction_bias().value, 0.0, 0.1);
      const Tensor x = randn({13, 10}, dt, rng), G = randn({13, 10}, dt, rng);
      MoeLayer::Saved s;
      const MoeLayer::Output out = m.forward(Context{}, x, Tensor(), &s);
      m.zero_grad();
      const Tensor dx = m.backward(Context{}, G, s);
      const OpsRef r = ops_pipeline(m, x, G);
      EXPECT_TRUE(bit_equal(out.topk_idx, r.route.topk_idx));
      EXPECT_TRUE(bit_equal(out.topk_weight, r.route.topk_weight));
      const testing::Tolerance tol =
          dt == DType::f64 ? testing::tolerance_for(DType::f64) : testing::Tolerance{1e-6, 1e-5};
      if (shared == 0)
        EXPECT_TRUE(bit_equal(out.y, r.y)) << dtype_name(dt);  // the same GEMMs and combine
      else
        EXPECT_TRUE(close(out.y, r.y, tol)) << dtype_name(dt);
      EXPECT_TRUE(close(dx, r.dx, tol)) << dtype_name(dt) << " shared " << shared;
      EXPECT_TRUE(close(m.experts_gate_up().grad, r.g.dgate_up, tol));
      EXPECT_TRUE(close(m.experts_down().grad, r.g.ddown, tol));
      EXPECT_TRUE(close(m.router().weight().grad, r.dgate, tol));
      if (shared) {
        const int64_t Is = 5;
        EXPECT_TRUE(close(m.shared_experts()->gate_proj().weight().grad,
                          r.g.dshared_gate_up.slice(0, 0, Is).contiguous(), tol));
        EXPECT_TRUE(close(m.shared_experts()->up_proj().weight().grad,
                          r.g.dshared_gate_up.slice(0, Is, 2 * Is).contiguous(), tol));
        EXPECT_TRUE(close(m.shared_experts()->down_proj().weight().grad, r.g.dshared_down, tol));
      }
      EXPECT_EQ(out.counts.to_f64_vector(), ops::moe_expert_load(out.topk_idx, 6).to_f64_vector());
      EXPECT_EQ(out.aux_loss, 0.0);
    }
  }
}

// Finite differences of loss = <y, G> + aux_loss with the selection fixed: every probe re-runs the
// forward and records whether the selection moved (it must not).
void fd_check(MoeConfig c, const SeqLayout& cu, Rng& rng) {
  MoeLayer m(c, policy(GemmKind::native), "model.layers.4.mlp");
  rng.fill_normal(m.correction_bias().value, 0.0, 0.05);
  const int64_t T = cu.total_tokens();
  Tensor x = randn({T, c.hidden_size}, DType::f64, rng);
  const Tensor G = randn({T, c.hidden_size}, DType::f64, rng);
  MoeLayer::Saved s;
  const MoeLayer::Output out = m.forward(Context{}, x, cu, &s);
  if (c.aux_loss_coeff > 0) EXPECT_GT(out.aux_loss, 0.0);
  const Tensor idx0 = out.topk_idx.clone();
  bool moved = false;
  auto loss = [&] {
    const MoeLayer::Output o = m.forward(Context{false, false}, x, cu, nullptr);
    if (!bit_equal(o.topk_idx, idx0)) moved = true;
    return dot(o.y, G) + o.aux_loss;
  };
  m.zero_grad();
  const Tensor dx = m.backward(Context{}, G, s, 1.0);
  EXPECT_TRUE(grad_check(loss, x, dx, 1e-6, 1e-6)) << "dx";
  for (auto& [name, p] : m.named_parameters()) {
    const Tensor g = p->grad.clone();
    EXPECT_TRUE(grad_check(loss, p->value, g, 1e-6, 1e-6, 60)) << name;
  }
  EXPECT_FALSE(moved) << "a probe changed the selection: pick another seed";
  // the correction bias has no gradient
  EXPECT_TRUE(bit_equal(m.correction_bias().grad, Tensor::zeros({c.n_experts}, DType::f64)));
}

TEST(MoeLayer, GradientsMatchFiniteDifferencesWithAuxLoss) {
  Rng rng(test_seed());
  MoeConfig c = moe_cfg(6, 6, 2, 3, 1, DType::f64, test_seed());
  c.swiglu_limit = 1.5;  // the clamp is active on some units
  c.aux_loss_coeff = 0.05;
  fd_check(c, SeqLayout::from_lengths({3, 4}), rng);
  // group-limited routing, no renormalisation, two shared experts, no clamp
  MoeConfig g = moe_cfg(5, 8, 3, 2, 2, DType::f64, test_seed() + 1);
  g.n_group = 4;
  g.topk_group = 2;
  g.norm_topk_prob = false;
  g.swiglu_limit = 0;
  g.aux_loss_coeff = 0.1;
  fd_check(g, SeqLayout::from_lengths({2, 0, 5}), rng);
}

TEST(MoeLayer, AuxLossIsPerSequenceAndDAuxScalesIt) {
  Rng rng(test_seed());
  MoeConfig c = moe_cfg(8, 8, 2, 4, 1, DType::f64, test_seed());
  c.aux_loss_coeff = 0.01;
  MoeLayer m(c, policy(GemmKind::native), "mlp");
  const std::vector<int64_t> lens{4, 1, 6};
  const Tensor x = randn({11, 8}, DType::f64, rng);
  const MoeLayer::Output out = m.forward(Context{}, x, SeqLayout::from_lengths(lens), nullptr);
  // the op on the router logits
  const Tensor logits = ops::matmul(x, false, m.router().weight().value, true);
  EXPECT_NEAR(
      out.aux_loss,
      ops::moe_seq_aux_loss(logits, out.topk_idx, SeqLayout::from_lengths(lens), c.aux_loss_coeff),
      1e-15);
  // packed value = mean of the sequences' values
  double mean = 0;
  int64_t t0 = 0;
  for (int64_t L : lens) {
    mean += m.forward(Context{}, sl(x, t0, t0 + L), Tensor(), nullptr).aux_loss / 3.0;
    t0 += L;
  }
  EXPECT_NEAR(out.aux_loss, mean, 1e-15);
  // no cu_seqlens: one sequence
  EXPECT_NEAR(
      m.forward(Context{}, x, Tensor(), nullptr).aux_loss,
      ops::moe_seq_aux_loss(logits, out.topk_idx, SeqLayout::from_lengths({11}), c.aux_loss_coeff),
      1e-15);
  // d_aux: the router gradient is linear in it; d_aux = 0 drops the aux term
  const Tensor G = randn({11, 8}, DType::f64, rng);
  Tensor gw[3];
  for (int i = 0; i < 3; ++i) {
    MoeLayer::Saved s;
    m.forward(Context{}, x, SeqLayout::from_lengths(lens), &s);
    m.zero_grad();
    m.backward(Context{}, G, s, double(i));  // 0, 1, 2
    gw[i] = m.router().weight().grad.clone();
  }
  const auto g0 = gw[0].to_f64_vector(), g1 = gw[1].to_f64_vector(), g2 = gw[2].to_f64_vector();
  double diff = 0;
  for (size_t i = 0; i < g0.size(); ++i) {
    EXPECT_NEAR(g2[i] - g0[i], 2 * (g1[i] - g0[i]), 1e-13);
    diff += std::fabs(g1[i] - g0[i]);
  }
  EXPECT_GT(diff, 1e-8);  // the aux term does reach the router
}

TEST(MoeLayer, ReplayOfItsOwnSelectionIsBitIdentical) {
  Rng rng(test_seed());
  MoeConfig c = moe_cfg(12, 8, 3, 6, 1, DType::f32, test_seed());
  c.aux_loss_coeff = 1e-3;
  MoeLayer m(c, policy(GemmKind::bf16), "mlp");
  const Tensor x = randn({17, 12}, DType::f32, rng), G = randn({17, 12}, DType::f32, rng);
  const SeqLayout cu = SeqLayout::from_lengths({9, 8});
  MoeLayer::Saved s0;
  const MoeLayer::Output o0 = m.forward(Context{}, x, cu, &s0);
  m.zero_grad();
  const Tensor dx0 = m.backward(Context{}, G, s0);
  const Tensor gw0 = m.router().weight().grad.clone(), gu0 = m.experts_gate_up().grad.clone();
  for (DType it : {DType::i64, DType::i32}) {
    MoeLayer::Saved s1;
    const MoeLayer::Output o1 = m.forward(Context{}, x, cu, &s1, o0.topk_idx.to(it));
    EXPECT_TRUE(bit_equal(o1.y, o0.y));
    EXPECT_TRUE(bit_equal(o1.topk_idx, o0.topk_idx));
    EXPECT_TRUE(bit_equal(o1.topk_weight, o0.topk_weight));
    EXPECT_EQ(o1.aux_loss, o0.aux_loss);
    m.zero_grad();
    EXPECT_TRUE(bit_equal(m.backward(Context{}, G, s1), dx0));
    EXPECT_TRUE(bit_equal(m.router().weight().grad, gw0));
    EXPECT_TRUE(bit_equal(m.experts_gate_up().grad, gu0));
  }
  // replaying other experts: they are used, with weights from the scores (R3)
  std::vector<int64_t> rep;
  for (int64_t t = 0; t < 17; ++t)
    for (int64_t k = 0; k < 3; ++k) rep.push_back((t + 2 * k) % 8);
  const Tensor ri = Tensor::from_vector<int64_t>({17, 3}, rep);
  const MoeLayer::Output o2 = m.forward(Context{}, x, cu, nullptr, ri);
  EXPECT_TRUE(bit_equal(o2.topk_idx, ri));
  const Tensor logits = ops::matmul(x, false, m.router().weight().value, true);
  EXPECT_TRUE(
      bit_equal(o2.topk_weight,
                ops::moe_router_forward(logits, Tensor(), c.router_config(), ri).topk_weight));
  EXPECT_FALSE(bit_equal(o2.y, o0.y));
}

TEST(MoeLayer, PackedBatchEqualsSequencesBitwise) {
  Rng rng(test_seed());
  for (GemmKind k : {GemmKind::native, GemmKind::bf16, GemmKind::fp8_block}) {
    MoeConfig c = moe_cfg(20, 6, 2, 9, 1, DType::f32, test_seed());
    c.swiglu_limit = 3.0;
    MoeLayer m(c, policy(k), "mlp");
    const std::vector<int64_t> lens{6, 1, 10};
    const Tensor x = randn({17, 20}, DType::f32, rng), G = randn({17, 20}, DType::f32, rng);
    MoeLayer::Saved s;
    const MoeLayer::Output o = m.forward(Context{}, x, SeqLayout::from_lengths(lens), &s);
    const Tensor dx = m.backward(Context{}, G, s);
    std::vector<double> counts(6, 0.0);
    int64_t t0 = 0;
    for (int64_t L : lens) {
      MoeLayer::Saved si;
      const MoeLayer::Output oi = m.forward(Context{}, sl(x, t0, t0 + L), Tensor(), &si);
      EXPECT_TRUE(bit_equal(oi.y, sl(o.y, t0, t0 + L))) << gemm_kind_name(k);
      EXPECT_TRUE(bit_equal(oi.topk_idx, sl(o.topk_idx, t0, t0 + L))) << gemm_kind_name(k);
      EXPECT_TRUE(bit_equal(oi.topk_weight, sl(o.topk_weight, t0, t0 + L)));
      EXPECT_TRUE(bit_equal(m.backward(Context{}, sl(G, t0, t0 + L), si), sl(dx, t0, t0 + L)))
          << gemm_kind_name(k);
      const auto ci = oi.counts.to_f64_vector();
      for (size_t e = 0; e < 6; ++e) counts[e] += ci[e];
      t0 += L;
    }
    EXPECT_EQ(counts, o.counts.to_f64_vector());
  }
}

TEST(MoeLayer, RecomputeAndRerunsAreBitIdentical) {
  Rng rng(test_seed());
  for (GemmKind k : {GemmKind::native, GemmKind::fp8_block}) {
    MoeConfig c = moe_cfg(100, 5, 2, 20, 1, DType::f32, test_seed());
    c.aux_loss_coeff = 1e-3;
    c.init_std = 0.05;
    MoeLayer m(c, policy(k), "mlp");
    const Tensor x = randn({11, 100}, DType::f32, rng), G = randn({11, 100}, DType::f32, rng);
    const SeqLayout cu = SeqLayout::from_lengths({5, 6});
    Tensor y[3], dx[3];
    std::vector<Tensor> grads[3];
    for (int r = 0; r < 3; ++r) {
      const Context ctx{true, r == 2};  // runs 0 and 1: plain (rerun), run 2: recompute
      MoeLayer::Saved s;
      y[r] = m.forward(ctx, x, cu, &s).y;
      EXPECT_EQ(s.recomputed, r == 2);
      EXPECT_EQ(s.eo.defined(), r != 2);
      m.zero_grad();
      dx[r] = m.backward(ctx, G, s);
      for (auto& [n, p] : m.named_parameters()) grads[r].push_back(p->grad.clone());
    }
    for (int r = 1; r < 3; ++r) {
      EXPECT_TRUE(bit_equal(y[r], y[0])) << gemm_kind_name(k) << " run " << r;
      EXPECT_TRUE(bit_equal(dx[r], dx[0])) << gemm_kind_name(k) << " run " << r;
      for (size_t i = 0; i < grads[0].size(); ++i)
        EXPECT_TRUE(bit_equal(grads[r][i], grads[0][i]))
            << gemm_kind_name(k) << " run " << r << " " << m.named_parameters()[i].first;
    }
  }
}

// The routed experts of a bf16 / fp8_block layer compute exactly what one Linear per expert (with
// the expert's weights copied in) computes on that expert's tokens in ascending order; the fused
// weight gradients equal those Linears' gradients.
TEST(MoeLayer, ExpertGemmsMatchPerExpertLinearBitwise) {
  Rng rng(test_seed());
  for (GemmKind kind : {GemmKind::bf16, GemmKind::fp8_block}) {
    PrecisionPolicy pol = policy(kind);
    pol.grad_format = Fp8Format::e5m2;
    const int64_t T = 21, D = 100, E = 4, K = 2, I = 40;
    MoeConfig c = moe_cfg(D, E, K, I, 0, DType::f32, test_seed());
    c.init_std = 0.05;
    c.swiglu_limit = 1.0;
    MoeLayer m(c, pol, "mlp");
    const GemmPrecision prec = m.expert_precision();
    ASSERT_EQ(prec.kind, kind);
    const Tensor x = randn({T, D}, DType::f32, rng), G = randn({T, D}, DType::f32, rng);
    MoeLayer::Saved s;
    const MoeLayer::Output o = m.forward(Context{}, x, Tensor(), &s);
    m.zero_grad();
    m.backward(Context{}, G, s);

    const std::vector<double> idx = o.topk_idx.to_f64_vector();
    const std::vector<double> w = o.topk_weight.to_f64_vector();
    std::vector<float> eo(size_t(T * K * D)), dO(size_t(T * K * D));
    const auto gv = G.to_f64_vector();
    for (int64_t a = 0; a < T * K; ++a)
      for (int64_t d = 0; d < D; ++d)
        dO[size_t(a * D + d)] = float(w[size_t(a)]) * float(gv[size_t((a / K) * D + d)]);
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> rows;
      for (int64_t a = 0; a < T * K; ++a)
        if (int64_t(idx[size_t(a)]) == e) rows.push_back(a);
      if (rows.empty()) continue;
      Linear lg(D, 2 * I, false, prec, DType::f32), ld(I, D, false, prec, DType::f32);
      lg.weight().value.copy_(m.experts_gate_up().value.select(0, e));
      ld.weight().value.copy_(m.experts_down().value.select(0, e));
      Tensor xe = Tensor::empty({int64_t(rows.size()), D}, DType::f32);
      Tensor dOe = Tensor::empty({int64_t(rows.size()), D}, DType::f32);
      for (size_t r = 0; r < rows.size(); ++r) {
        xe.select(0, int64_t(r)).copy_(x.select(0, rows[r] / K));
        dOe.select(0, int64_t(r))
            .copy_(Tensor::from_values(
                {D}, std::vector<double>(dO.begin() + rows[r] * D, dO.begin() + (rows[r] + 1) * D),
                DType::f32));
      }
      Linear::Saved sg, sd;
      const Tensor gu = lg.forward(Context{}, xe, &sg);
      const Tensor eoe = ld.forward(Context{}, ops::swiglu_clamped_forward(gu, 1.0), &sd);
      const auto ev = eoe.to_f64_vector();
      for (size_t r = 0; r < rows.size(); ++r)
        for (int64_t d = 0; d < D; ++d) eo[size_t(rows[r] * D + d)] = float(ev[r * size_t(D) + d]);
      lg.zero_grad();
      ld.zero_grad();
      const Tensor dh = ld.backward(Context{}, dOe, sd);
      lg.backward(Context{}, ops::swiglu_clamped_backward(gu, dh, 1.0), sg);
      EXPECT_TRUE(bit_equal(m.experts_gate_up().grad.select(0, e).contiguous(), lg.weight().grad))
          << gemm_kind_name(kind) << " expert " << e;
      EXPECT_TRUE(bit_equal(m.experts_down().grad.select(0, e).contiguous(), ld.weight().grad))
          << gemm_kind_name(kind) << " expert " << e;
    }
    std::vector<double> y(size_t(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += float(w[size_t(t * K + k)]) * eo[size_t((t * K + k) * D + d)];
        y[size_t(t * D + d)] = acc;
      }
    EXPECT_TRUE(bit_equal(o.y, Tensor::from_values({T, D}, y, DType::f32))) << gemm_kind_name(kind);
    // and the precision matters: native differs
    MoeLayer n(c, policy(GemmKind::native), "mlp");
    EXPECT_FALSE(bit_equal(n.forward(Context{}, x, Tensor(), nullptr).y, o.y));
  }
}

TEST(MoeLayer, BiasUpdateSignRuleAndSelectionOnly) {
  MoeLayer m(moe_cfg(8, 4, 2, 4, 1, DType::f32, 9), policy(GemmKind::native), "mlp");
  m.correction_bias().value.copy_(Tensor::from_values({4}, {0.1, 0.0, -0.2, 0.3}, DType::f32));
  // loads 4, 2, 1, 1 (mean 2): over-loaded down, at-mean unchanged, under-loaded up
  m.update_bias(Tensor::from_vector<int64_t>({4}, {4, 2, 1, 1}), 1e-3);
  const auto b = m.correction_bias().value.to_f64_vector();
  EXPECT_EQ(float(b[0]), float(0.1) - float(1e-3));
  EXPECT_EQ(float(b[1]), 0.0f);
  EXPECT_EQ(float(b[2]), float(-0.2) + float(1e-3));
  EXPECT_EQ(float(b[3]), float(0.3) + float(1e-3));
  EXPECT_EQ(m.correction_bias().value.dtype(), DType::f32);
  m.update_bias(Tensor::from_vector<int64_t>({4}, {3, 3, 3, 3}), 1e-3);  // balanced: no move
  EXPECT_EQ(m.correction_bias().value.to_f64_vector(), b);
  expect_error([&] { m.update_bias(Tensor::zeros({3}, DType::i64), 1e-3); }, "load");
  // a large bias selects expert 2 for every token, but its weight is the unbiased score's
  Rng rng(test_seed());
  const Tensor x = randn({9, 8}, DType::f32, rng);
  m.correction_bias().value.copy_(Tensor::from_values({4}, {0, 0, 5, 0}, DType::f32));
  const MoeLayer::Output o = m.forward(Context{}, x, Tensor(), nullptr);
  const Tensor logits = ops::matmul(x, false, m.router().weight().value, true);
  const ops::MoeRouterResult ref =
      ops::moe_router_forward(logits, Tensor(), m.config().router_config(), o.topk_idx);
  for (int64_t t = 0; t < 9; ++t) EXPECT_EQ(o.topk_idx.at({t, 0}), 2.0);
  EXPECT_TRUE(bit_equal(o.topk_weight, ref.topk_weight));
  EXPECT_EQ(o.counts.at({2}), 9.0);
}

TEST(MoeLayer, Bf16ParametersAndActivations) {
  Rng rng(test_seed());
  MoeConfig c = moe_cfg(16, 6, 2, 8, 1, DType::f32, test_seed());
  c.init_std = 0.1;
  MoeLayer m(c, policy(GemmKind::native), "mlp");
  m.to_dtype(DType::bf16);
  EXPECT_EQ(m.experts_gate_up().value.dtype(), DType::bf16);
  EXPECT_EQ(m.router().weight().value.dtype(), DType::f32);
  MoeLayer t(c, policy(GemmKind::native), "mlp");  // f32 twin holding the same values
  for (auto& [n, p] : m.named_parameters()) t.find_parameter(n)->value.copy_(p->value);
  const Tensor x = randn({7, 16}, DType::f32, rng), G = randn({7, 16}, DType::f32, rng);
  MoeLayer::Saved sm, st;
  EXPECT_TRUE(bit_equal(m.forward(Context{}, x, Tensor(), &sm).y,
                        t.forward(Context{}, x, Tensor(), &st).y));
  m.zero_grad();
  t.zero_grad();
  EXPECT_TRUE(bit_equal(m.backward(Context{}, G, sm), t.backward(Context{}, G, st)));
  EXPECT_EQ(m.experts_down().grad.dtype(), DType::f32);
  EXPECT_TRUE(bit_equal(m.experts_down().grad, t.experts_down().grad));
  // bf16 activations in, bf16 out
  MoeLayer::Saved sb;
  const MoeLayer::Output ob = m.forward(Context{}, x.to(DType::bf16), Tensor(), &sb);
  EXPECT_EQ(ob.y.dtype(), DType::bf16);
  EXPECT_EQ(ob.topk_weight.dtype(), DType::f32);  // the router runs in FP32
  EXPECT_EQ(m.backward(Context{}, G, sb).dtype(), DType::bf16);
}

TEST(MoeLayer, BadConfigAndInputsThrow) {
  const PrecisionPolicy pol = policy(GemmKind::native);
  auto make = [&](const MoeConfig& c) { MoeLayer m(c, pol, "mlp"); };
  const MoeConfig ok = moe_cfg(8, 8, 2, 4, 1, DType::f32, 0);
  struct Case {
    std::function<void(MoeConfig&)> edit;
    const char* field;
  };
  const std::vector<Case> cases{
      {[](MoeConfig& c) { c.hidden_size = 0; }, "hidden_size"},
      {[](MoeConfig& c) { c.n_experts = 0; }, "n_experts"},
      {[](MoeConfig& c) { c.top_k = 9; }, "top_k"},
      {[](MoeConfig& c) { c.top_k = 0; }, "top_k"},
      {[](MoeConfig& c) { c.n_group = 3; }, "n_group"},
      {[](MoeConfig& c) { c.n_group = 8, c.topk_group = 4; }, "n_group"},
      {[](MoeConfig& c) { c.n_group = 4, c.topk_group = 5; }, "topk_group"},
      {[](MoeConfig& c) { c.n_group = 4, c.topk_group = 1, c.top_k = 3; }, "top_k"},
      {[](MoeConfig& c) { c.routed_scaling_factor = 0; }, "routed_scaling_factor"},
      {[](MoeConfig& c) { c.moe_intermediate_size = 0; }, "moe_intermediate_size"},
      {[](MoeConfig& c) { c.n_shared_experts = -1; }, "n_shared_experts"},
      {[](MoeConfig& c) { c.swiglu_limit = std::nan(""); }, "swiglu_limit"},
      {[](MoeConfig& c) { c.aux_loss_coeff = -1; }, "aux_loss_coeff"},
      {[](MoeConfig& c) { c.dtype = DType::i64; }, "dtype"},
      {[](MoeConfig& c) { c.init_std = -1; }, "init_std"},
  };
  for (const Case& k : cases) {
    MoeConfig c = ok;
    k.edit(c);
    expect_error([&] { make(c); }, std::string("MoeConfig.") + k.field);
  }
  // inputs
  MoeLayer m(ok, pol, "model.layers.3.mlp");
  Rng rng(test_seed());
  const Tensor x = randn({5, 8}, DType::f32, rng);
  expect_error(
      [&] {
        m.forward(Context{}, randn({5, 7}, DType::f32, rng), Tensor(), nullptr);
      },
      "[T, 8]");
  expect_error(
      [&] {
        m.forward(Context{}, x, SeqLayout::from_lengths({2, 2}), nullptr);
      },
      "the sequence layout covers 4 tokens, x has 5");
  std::vector<int64_t> dup(10, 0);
  expect_error(
      [&] {
        m.forward(Context{}, x, Tensor(), nullptr, Tensor::from_vector<int64_t>({5, 2}, dup));
      },
      "replay_idx");
  expect_error(
      [&] {
        m.forward(Context{}, x, Tensor(), nullptr, Tensor::zeros({5, 3}, DType::i64));
      },
      "replay_idx");
  MoeLayer::Saved empty;
  expect_error([&] { m.backward(Context{}, x, empty); }, "Saved");
  MoeLayer::Saved s;
  m.forward(Context{}, x, Tensor(), &s);
  expect_error([&] { m.backward(Context{}, randn({4, 8}, DType::f32, rng), s); }, "dy");
  expect_error([&] { m.backward(Context{}, x, s, std::nan("")); }, "d_aux");
  MoeLayer::Saved si;
  m.forward(Context{false, false}, x, Tensor(), &si);
  EXPECT_FALSE(si.x.defined());
}

}  // namespace
}  // namespace hlm
