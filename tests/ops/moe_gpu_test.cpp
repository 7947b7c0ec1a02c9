// The CUDA MoE ops (ops/moe.h) against the CPU op on the same inputs: the router (selection equal
// to the CPU's, ties included, groups, replay, backward), the expert load and the bias update
// (bit-equal), the sequence-wise aux loss and its gradient, the clamped SwiGLU and the combine
// (f32, f64, bf16), and the experts forward / backward (every output, saved tensor and gradient;
// T = 1, 9, 70 tokens, 16 experts top-4, D = 64, I = 32; experts without tokens; accumulators of
// another dtype). Outputs are NaN-poisoned, reruns bit-identical, bad arguments refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/device.h"
#include "gpu_compare.h"
#include "ops/dispatch.h"
#include "ops/moe.h"

namespace hlm {
namespace {

using gpu_compare::check;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::bit_equal;
using testing::cpu;
using testing::gpu;

ops::MoeRouterConfig router_cfg(int64_t E, int64_t K, int64_t G = 1, int64_t kg = 1,
                                bool norm = true) {
  ops::MoeRouterConfig c;
  c.n_experts = E;
  c.top_k = K;
  c.n_group = G;
  c.topk_group = kg;
  c.norm_topk_prob = norm;
  return c;
}

// Logits on a coarse grid (many exact ties), or normal ones.
Tensor router_logits(int64_t T, int64_t E, DType dt, Rng& rng, bool ties) {
  if (!ties) return randn({T, E}, dt, rng, 2.0);
  std::vector<double> v = rand_uniform({T, E}, DType::f64, rng, 0, 3).to_f64_vector();
  for (double& x : v) x = std::floor(x) * 0.5;
  return Tensor::from_values({T, E}, v, dt);
}

void check_router(const Tensor& logits, const Tensor& bias, const ops::MoeRouterConfig& c,
                  const Tensor& replay, Rng& rng) {
  const DType dt = logits.dtype();
  const ops::MoeRouterResult ref = ops::moe_router_forward(logits, bias, c, replay);
  const ops::MoeRouterResult r = ops::moe_router_forward(gpu(logits), gpu(bias), c, gpu(replay));
  EXPECT_TRUE(bit_equal(cpu(r.topk_idx), ref.topk_idx)) << "topk_idx";
  check("router scores", r.scores, ref.scores, dt);
  check("router topk_weight", r.topk_weight, ref.topk_weight, dt);
  const Tensor dw = randn(ref.topk_weight.shape(), dt, rng);
  const Tensor dl_ref = ops::moe_router_backward(logits, ref, c, dw);
  const Tensor dl = ops::moe_router_backward(gpu(logits), r, c, gpu(dw));
  // Scaled by the largest upstream gradient: with top-1 and normalised weights (a weight that is
  // 1 whatever the logit) the reference is rounding noise of ~1e-18, which a GPU's fused
  // multiply-adds round to other noise (measured on an H200: 0 against -2.2e-18).
  double dw_max = 0;
  for (double v : dw.to_f64_vector()) dw_max = std::max(dw_max, std::fabs(v));
  check("router dlogits", dl, dl_ref, dt, 0, dw_max);
  const ops::MoeRouterResult r2 = ops::moe_router_forward(gpu(logits), gpu(bias), c, gpu(replay));
  EXPECT_TRUE(bit_equal(cpu(r2.topk_idx), cpu(r.topk_idx)));
  EXPECT_TRUE(bit_equal(cpu(r2.scores), cpu(r.scores)));
  EXPECT_TRUE(bit_equal(cpu(r2.topk_weight), cpu(r.topk_weight)));
  EXPECT_TRUE(bit_equal(cpu(ops::moe_router_backward(gpu(logits), r, c, gpu(dw))), cpu(dl)));
}

TEST(MoeRouterGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  struct Cfg {
    int64_t E, K, G, kg;
    bool norm;
  };
  const std::vector<Cfg> cfgs = {{16, 4, 1, 1, true},
                                 {16, 4, 4, 2, true},
                                 {16, 4, 1, 1, false},
                                 {24, 5, 6, 3, true},
                                 {40, 1, 1, 1, true}};
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t T : {1, 9, 70})
      for (const Cfg& g : cfgs)
        for (bool ties : {false, true})
          for (bool with_bias : {false, true}) {
            SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " T " << T << " E " << g.E
                                              << " G " << g.G << " ties " << ties);
            const auto c = router_cfg(g.E, g.K, g.G, g.kg, g.norm);
            const Tensor logits = router_logits(T, g.E, dt, rng, ties);
            // a bias on the same coarse grid keeps ties among biased scores
            const Tensor bias = with_bias ? (ties ? router_logits(1, g.E, dt, rng, true).view({g.E})
                                                  : randn({g.E}, dt, rng, 0.3))
                                          : Tensor();
            check_router(logits, bias, c, Tensor(), rng);
          }
}

TEST(MoeRouterGpu, GlmShapeReplayAndTies) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  // GLM-5.3-Flash: 288 experts, top-8, one group, scaling 2.5, FP32 (f32 bias of a different
  // scale than the scores, as the trained correction bias).
  const auto glm = router_cfg(288, 8);
  check_router(randn({9, 288}, DType::f32, rng, 1.5), randn({288}, DType::f32, rng, 0.05), glm,
               Tensor(), rng);
  check_router(router_logits(9, 288, DType::f32, rng, true), Tensor(), glm, Tensor(), rng);
  // Every logit equal: experts 0..K-1 in order; the f64 bias of an f32 router (read as f32).
  check_router(Tensor::zeros({3, 288}, DType::f32), Tensor(), glm, Tensor(), rng);
  check_router(randn({5, 16}, DType::f32, rng), randn({16}, DType::f64, rng, 0.2),
               router_cfg(16, 4), Tensor(), rng);
  // replay: i64 and i32 indices, in any order
  const auto c = router_cfg(16, 4);
  const Tensor logits = randn({9, 16}, DType::f32, rng);
  std::vector<int64_t> rp;
  for (int64_t t = 0; t < 9; ++t)
    for (int64_t k = 0; k < 4; ++k) rp.push_back((t * 5 + k * 3 + 1) % 16);
  const Tensor replay = Tensor::from_vector<int64_t>({9, 4}, rp);
  check_router(logits, Tensor(), c, replay, rng);
  check_router(logits.to(DType::f64), Tensor(), c, replay.to(DType::i32), rng);
  // an i32 selection handed to the backward
  const ops::MoeRouterResult r = ops::moe_router_forward(gpu(logits), Tensor(), c);
  ops::MoeRouterResult r32 = r;
  r32.topk_idx = gpu(cpu(r.topk_idx).to(DType::i32));
  const Tensor dw = gpu(randn({9, 4}, DType::f32, rng));
  EXPECT_TRUE(bit_equal(cpu(ops::moe_router_backward(gpu(logits), r32, c, dw)),
                        cpu(ops::moe_router_backward(gpu(logits), r, c, dw))));
}

TEST(MoeBalanceGpu, LoadBiasUpdateAndAuxLoss) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  const int64_t E = 16, K = 4;
  const auto c = router_cfg(E, K);
  for (DType dt : {DType::f32, DType::f64})
    for (const std::vector<int64_t>& lens :
         std::vector<std::vector<int64_t>>{{1}, {9}, {70}, {5, 0, 40, 1, 24}, {300}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " seqs " << lens.size());
      const int64_t T = testing::total(lens);
      const Tensor logits = randn({T, E}, dt, rng, 2.0);
      const ops::MoeRouterResult r = ops::moe_router_forward(logits, Tensor(), c);
      const Tensor idx = r.topk_idx;
      // expert load (i64 and i32 indices)
      const Tensor load = ops::moe_expert_load(idx, E);
      EXPECT_TRUE(bit_equal(cpu(ops::moe_expert_load(gpu(idx), E)), load));
      EXPECT_TRUE(bit_equal(cpu(ops::moe_expert_load(gpu(idx.to(DType::i32)), E)), load));
      // bias update: device load (i64, f32) and host load
      for (DType bdt : {DType::f32, DType::f64}) {
        const Tensor b0 = randn({E}, bdt, rng, 0.01);
        Tensor bc = b0.clone();
        ops::moe_bias_update(bc, load, 1e-3);
        for (const Tensor& ld : {gpu(load), load, gpu(load.to(DType::f32))}) {
          Tensor bg = gpu(b0);
          ops::moe_bias_update(bg, ld, 1e-3);
          EXPECT_TRUE(bit_equal(cpu(bg), bc));
        }
      }
      // seq aux loss and its gradient
      const SeqLayout seqs = testing::seqs_of(lens);
      const double coeff = 0.001;
      const double loss_ref = ops::moe_seq_aux_loss(logits, idx, seqs, coeff);
      const double loss = ops::moe_seq_aux_loss(gpu(logits), gpu(idx), seqs, coeff);
      std::printf("  aux loss %-5s T %4lld  cpu %.17g  gpu %.17g  rel %.3e\n", dtype_name(dt),
                  (long long)T, loss_ref, loss, std::fabs(loss - loss_ref) / std::fabs(loss_ref));
      EXPECT_LE(std::fabs(loss - loss_ref),
                (dt == DType::f32 ? 2e-5 : 1e-12) * std::fabs(loss_ref));
      EXPECT_EQ(ops::moe_seq_aux_loss(gpu(logits), gpu(idx), seqs, coeff), loss);
      const Tensor dl_ref = ops::moe_seq_aux_loss_backward(logits, idx, seqs, coeff, 0.7);
      const Tensor dl = ops::moe_seq_aux_loss_backward(gpu(logits), gpu(idx), seqs, coeff, 0.7);
      check("aux dlogits", dl, dl_ref, dt);
      EXPECT_TRUE(bit_equal(cpu(ops::moe_seq_aux_loss_backward(gpu(logits), gpu(idx.to(DType::i32)),
                                                               seqs, coeff, 0.7)),
                            cpu(dl)));
    }
  // Context-parallel pieces (a sequence's whole length and counts given): the GPU's pieces
  // against the CPU's whole batch, cut inside sequences.
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::vector<int64_t> lens{40, 3, 0, 90, 1};
    const SeqLayout seqs = testing::seqs_of(lens);
    const Tensor logits = randn({134, E}, dt, rng, 2.0);
    const Tensor idx = ops::moe_router_forward(logits, Tensor(), c).topk_idx;
    const double coeff = 0.01, whole = ops::moe_seq_aux_loss(logits, idx, seqs, coeff);
    const Tensor dwhole = ops::moe_seq_aux_loss_backward(logits, idx, seqs, coeff, 1.0);
    double sum = 0;
    for (const testing::AuxPiece& p : testing::aux_pieces(seqs, idx, E, {0, 20, 42, 43, 134})) {
      const Tensor l = gpu(logits.slice(0, p.begin, p.end).contiguous());
      const Tensor i = gpu(idx.slice(0, p.begin, p.end).contiguous());
      const double share = double(p.seqs.num_seqs()) / 4.0;
      sum += ops::moe_seq_aux_loss(l, i, p.seqs, coeff, &p.whole) * share;
      check("aux dlogits of a piece",
            ops::moe_seq_aux_loss_backward(l, i, p.seqs, coeff, share, &p.whole),
            dwhole.slice(0, p.begin, p.end).contiguous(), dt);
    }
    EXPECT_LE(std::fabs(sum - whole), (dt == DType::f32 ? 2e-5 : 1e-12) * std::fabs(whole));
  }
  // every sigmoid underflows in FP32: the rescaled scores, finite
  const Tensor low = Tensor::full({6, E}, -120.0, DType::f32);
  std::vector<double> lv = low.to_f64_vector();
  for (size_t i = 0; i < lv.size(); ++i) lv[i] -= double(i % 7);
  const Tensor lowv = Tensor::from_values({6, E}, lv, DType::f32);
  const Tensor idx = ops::moe_router_forward(lowv, Tensor(), c).topk_idx;
  const SeqLayout seqs = testing::seqs_of({2, 4});
  const double lref = ops::moe_seq_aux_loss(lowv, idx, seqs, 0.01);
  const double lgpu = ops::moe_seq_aux_loss(gpu(lowv), gpu(idx), seqs, 0.01);
  EXPECT_TRUE(std::isfinite(lgpu));
  EXPECT_LE(std::fabs(lgpu - lref), 2e-5 * std::fabs(lref));
  check("aux dlogits (underflow)", ops::moe_seq_aux_loss_backward(gpu(lowv), gpu(idx), seqs, 0.01),
        ops::moe_seq_aux_loss_backward(lowv, idx, seqs, 0.01), DType::f32);
}

TEST(MoeSwigluGpu, ClampForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const Shape& s : {Shape{1, 2}, Shape{70, 64}, Shape{3, 5, 14}})
      for (double limit : {10.0, 0.75, 0.0}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dt) << " " << shape_str(s) << " limit " << limit);
        Pair gu = make(s, dt, rng, 1.5);
        if (limit > 0 && s.back() >= 4) {
          // entries exactly at the limits: the gradient passes (closed interval)
          std::vector<double> v = gu.ref.to_f64_vector();
          const int64_t I = s.back() / 2;
          v[0] = limit;
          v[size_t(I)] = -limit;
          v[size_t(I) + 1] = limit;
          gu.ref = Tensor::from_values(s, v, gu.ref.dtype());
          gu.dev = gpu(gu.ref.to(dt));
        }
        Shape hs = s;
        hs.back() /= 2;
        const Pair dh = make(hs, dt, rng);
        const Tensor h_ref = ops::swiglu_clamped_forward(gu.ref, limit);
        const Tensor h = ops::swiglu_clamped_forward(gu.dev, limit);
        EXPECT_EQ(h.dtype(), dt);
        check("swiglu h", h, h_ref, dt);
        const Tensor dgu_ref = ops::swiglu_clamped_backward(gu.ref, dh.ref, limit);
        const Tensor dgu = ops::swiglu_clamped_backward(gu.dev, dh.dev, limit);
        check("swiglu dgu", dgu, dgu_ref, dt);
        EXPECT_TRUE(bit_equal(cpu(ops::swiglu_clamped_forward(gu.dev, limit)), cpu(h)));
        if (dt == DType::f32)  // h in bf16: the f32 h rounded once, as the CPU's
          EXPECT_TRUE(bit_equal(cpu(ops::swiglu_clamped_forward(gu.dev, limit, DType::bf16)),
                                cpu(h).to(DType::bf16)));
        EXPECT_TRUE(bit_equal(cpu(ops::swiglu_clamped_backward(gu.dev, dh.dev, limit)), cpu(dgu)));
      }
  // a strided gu and a dh of another dtype
  const Tensor g = randn({6, 20}, DType::f32, rng);
  const Tensor gs = g.slice(1, 2, 18);  // [6, 16], row stride 20
  const Tensor dh = randn({6, 8}, DType::f64, rng);
  check("swiglu h (strided)", ops::swiglu_clamped_forward(gpu(g).slice(1, 2, 18), 1.0),
        ops::swiglu_clamped_forward(gs, 1.0), DType::f32);
  check("swiglu dgu (f64 dh)", ops::swiglu_clamped_backward(gpu(gs.contiguous()), gpu(dh), 1.0),
        ops::swiglu_clamped_backward(gs, dh, 1.0), DType::f32);
}

TEST(MoeCombineGpu, ForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t T : {1, 9, 70})
      for (int variant = 0; variant < 4; ++variant) {
        const int64_t K = variant == 3 ? 1 : 4, D = variant == 2 ? 33 : 64;
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dt) << " T " << T << " variant " << variant);
        const Pair eo = make({T, K, D}, dt, rng);
        // bf16 eo: w in f32 (variant 0) or bf16
        const DType wdt = dt == DType::bf16 && variant == 0 ? DType::f32 : dt;
        const Pair w = make({T, K}, wdt, rng);
        const Pair sh = make({T, D}, dt, rng);
        const bool with_shared = variant != 1;
        const Tensor out_ref = ops::moe_combine(eo.ref, w.ref, with_shared ? sh.ref : Tensor());
        const Tensor out = ops::moe_combine(eo.dev, w.dev, with_shared ? sh.dev : Tensor());
        check("combine out", out, out_ref, dt);
        check("combine sum", ops::moe_combine(eo.dev, Tensor(), sh.dev),
              ops::moe_combine(eo.ref, Tensor(), sh.ref), dt);
        const Pair dout = make({T, D}, dt, rng);
        const ops::MoeCombineGrads g_ref = ops::moe_combine_backward(dout.ref, eo.ref, w.ref);
        const ops::MoeCombineGrads g = ops::moe_combine_backward(dout.dev, eo.dev, w.dev);
        EXPECT_EQ(g.dw.dtype(), wdt);
        check("combine dw", g.dw, g_ref.dw, wdt);
        check("combine deo", g.deo, g_ref.deo, dt);
        EXPECT_TRUE(bit_equal(cpu(ops::moe_combine(eo.dev, w.dev, sh.dev)),
                              cpu(ops::moe_combine(eo.dev, w.dev, sh.dev))));
        const ops::MoeCombineGrads g2 = ops::moe_combine_backward(dout.dev, eo.dev, w.dev);
        EXPECT_TRUE(bit_equal(cpu(g2.dw), cpu(g.dw)));
        EXPECT_TRUE(bit_equal(cpu(g2.deo), cpu(g.deo)));
      }
}

// ---- experts ------------------------------------------------------------------------------------
struct ExpertCase {
  Pair x;
  Tensor gate_up, down, sgu, sdown, idx, w;  // CPU tensors (f32 / f64)
};

// skew: 0 router selection, 1 every token on experts {3, 0, 7, 12} (most experts empty),
// 2 experts 0..K-1 for the first half and the last K for the rest.
ExpertCase make_experts(int64_t T, int64_t D, int64_t E, int64_t I, int64_t K, int64_t Is, DType dt,
                        int skew, Rng& rng) {
  const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
  ExpertCase m;
  m.x = make({T, D}, dt, rng);
  m.gate_up = randn({E, 2 * I, D}, cdt, rng, 0.3);
  m.down = randn({E, D, I}, cdt, rng, 0.3);
  m.sgu = randn({2 * Is, D}, cdt, rng, 0.3);
  m.sdown = randn({D, Is}, cdt, rng, 0.3);
  const ops::MoeRouterResult r =
      ops::moe_router_forward(randn({T, E}, cdt, rng), Tensor(), router_cfg(E, K));
  m.w = r.topk_weight;
  if (skew == 0) {
    m.idx = r.topk_idx;
  } else {
    std::vector<int64_t> v;
    const int64_t fixed[4] = {3, 0, 7, 12};
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        v.push_back(skew == 1 ? fixed[k % 4] + 4 * (k / 4) : (2 * t < T ? k : E - K + k));
    m.idx = Tensor::from_vector<int64_t>({T, K}, v);
  }
  return m;
}

void check_experts(const ExpertCase& m, DType dt, bool shared, DType acc_dt, double limit,
                   Rng& rng) {
  const int64_t T = m.x.ref.size(0), D = m.x.ref.size(1);
  const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
  const ops::MoeWeights wc{m.gate_up, m.down, shared ? m.sgu : Tensor(),
                           shared ? m.sdown : Tensor()};
  const ops::MoeWeights wg{gpu(m.gate_up), gpu(m.down), gpu(wc.shared_gate_up),
                           gpu(wc.shared_down)};
  ops::MoeSaved sc, sg;
  const Tensor out_ref = ops::moe_experts_forward(m.x.ref, wc, m.idx, m.w, limit, sc);
  const Tensor out = ops::moe_experts_forward(m.x.dev, wg, gpu(m.idx), gpu(m.w), limit, sg);
  EXPECT_EQ(out.dtype(), cdt);
  check("experts out", out, out_ref, cdt);
  check("experts saved gu", sg.gu, sc.gu, cdt);
  check("experts saved h", sg.h, sc.h, cdt);
  check("experts saved eo", sg.eo, sc.eo, cdt);
  EXPECT_TRUE(bit_equal(cpu(sg.topk_idx), sc.topk_idx.to(DType::i64)));
  // backward onto non-zero accumulators
  const Tensor dout = randn({T, D}, cdt, rng);
  auto accs = [&](const ops::MoeWeights& w, bool on_gpu) {
    Rng r0(7);
    auto mk = [&](const Tensor& p) {
      if (!p.defined()) return Tensor();
      const Tensor a = randn(p.shape(), acc_dt, r0, 0.1);
      return on_gpu ? gpu(a) : a;
    };
    return ops::MoeWeightGrads{mk(w.gate_up), mk(w.down), mk(w.shared_gate_up), mk(w.shared_down)};
  };
  ops::MoeWeightGrads gc = accs(wc, false), gg = accs(wc, true);
  const ops::MoeGrads rc = ops::moe_experts_backward(sc, wc, dout, gc);
  const ops::MoeGrads rg = ops::moe_experts_backward(sg, wg, gpu(dout), gg);
  check("experts dx", rg.dx, rc.dx, cdt);
  check("experts dtopk_weight", rg.dtopk_weight, rc.dtopk_weight, cdt);
  // the bound of the weight gradients: f64 only when both computation and accumulator are f64
  const DType gdt = cdt == DType::f64 && acc_dt == DType::f64 ? DType::f64 : DType::f32;
  check("experts dgate_up", gg.dgate_up, gc.dgate_up, gdt);
  check("experts ddown", gg.ddown, gc.ddown, gdt);
  if (shared) {
    check("experts dshared_gate_up", gg.dshared_gate_up, gc.dshared_gate_up, gdt);
    check("experts dshared_down", gg.dshared_down, gc.dshared_down, gdt);
  }
  // reruns: the same bits
  ops::MoeSaved s2;
  EXPECT_TRUE(bit_equal(cpu(ops::moe_experts_forward(m.x.dev, wg, gpu(m.idx), gpu(m.w), limit, s2)),
                        cpu(out)));
  ops::MoeWeightGrads g2 = accs(wc, true);
  const ops::MoeGrads r2 = ops::moe_experts_backward(s2, wg, gpu(dout), g2);
  EXPECT_TRUE(bit_equal(cpu(r2.dx), cpu(rg.dx)));
  EXPECT_TRUE(bit_equal(cpu(r2.dtopk_weight), cpu(rg.dtopk_weight)));
  EXPECT_TRUE(bit_equal(cpu(g2.dgate_up), cpu(gg.dgate_up)));
  EXPECT_TRUE(bit_equal(cpu(g2.ddown), cpu(gg.ddown)));
  if (shared) {
    EXPECT_TRUE(bit_equal(cpu(g2.dshared_gate_up), cpu(gg.dshared_gate_up)));
    EXPECT_TRUE(bit_equal(cpu(g2.dshared_down), cpu(gg.dshared_down)));
  }
}

TEST(MoeExpertsGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  const int64_t D = 64, E = 16, I = 32, K = 4, Is = 32;
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t T : {1, 9, 70}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " T " << T);
      check_experts(make_experts(T, D, E, I, K, Is, dt, 0, rng), dt, true, dt, 10.0, rng);
    }
  // bf16 activations (computed in f32), a small clamp, no shared expert, skewed routing, an f64
  // accumulator of an f32 computation, odd sizes
  check_experts(make_experts(9, D, E, I, K, Is, DType::bf16, 0, rng), DType::bf16, true, DType::f32,
                10.0, rng);
  check_experts(make_experts(70, D, E, I, K, Is, DType::f32, 1, rng), DType::f32, false, DType::f32,
                0.5, rng);
  check_experts(make_experts(9, D, E, I, K, Is, DType::f32, 2, rng), DType::f32, true, DType::f64,
                10.0, rng);
  check_experts(make_experts(5, 33, 7, 9, 3, 11, DType::f64, 0, rng), DType::f64, true, DType::f32,
                1.0, rng);
}

TEST(MoeExpertsGpu, EmptyBatchAndMixedInputDtypes) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  // T = 0: an empty output and zero gradients
  const ExpertCase m = make_experts(3, 16, 4, 8, 2, 8, DType::f32, 0, rng);
  const ops::MoeWeights wg{gpu(m.gate_up), gpu(m.down), gpu(m.sgu), gpu(m.sdown)};
  ops::MoeSaved s;
  const Tensor x0 = gpu(Tensor::zeros({0, 16}, DType::f32));
  const Tensor out = ops::moe_experts_forward(x0, wg, gpu(Tensor::zeros({0, 2}, DType::i64)),
                                              gpu(Tensor::zeros({0, 2}, DType::f32)), 10.0, s);
  EXPECT_EQ(out.shape(), Shape({0, 16}));
  // f64 weights and an i32 selection with f32 x: the weights read as f32
  const ops::MoeWeights wc{m.gate_up, m.down, m.sgu, m.sdown};
  const ops::MoeWeights w64{gpu(m.gate_up.to(DType::f64)), gpu(m.down.to(DType::f64)),
                            gpu(m.sgu.to(DType::f64)), gpu(m.sdown.to(DType::f64))};
  ops::MoeSaved sc, sg;
  check("experts out (f64 weights)",
        ops::moe_experts_forward(m.x.dev, w64, gpu(m.idx.to(DType::i32)), gpu(m.w), 10.0, sg),
        ops::moe_experts_forward(m.x.ref, wc, m.idx, m.w, 10.0, sc), DType::f32);
}

// moe_routed_experts on CUDA: the CPU op's numbers (which follow the kernel's summation order),
// a token's rows the same bits alone as in its batch, the host never waiting (no device-to-host
// copy), NaN rows for indices outside [0, E), reruns bit-identical.
TEST(MoeRoutedExpertsGpu, MatchesCpuBatchInvariantNoHostWait) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  struct Case {
    int64_t T, D, E, I, K;
    DType x, w;
    bool rb;
    int skew;
  };
  int64_t equal = 0, total = 0;
  for (const Case c : {Case{9, 64, 16, 32, 4, DType::f32, DType::f32, false, 0},
                       Case{70, 64, 16, 32, 4, DType::f32, DType::f32, false, 1},
                       Case{9, 64, 16, 32, 4, DType::f64, DType::f64, false, 0},
                       Case{9, 64, 16, 32, 4, DType::f32, DType::f32, true, 0},
                       Case{70, 64, 16, 32, 4, DType::f32, DType::bf16, true, 2},
                       Case{5, 33, 7, 9, 3, DType::f32, DType::bf16, true, 0},
                       // Rows longer than a warp's 256-k step: vector spans (520) and spans cut
                       // at the row's end (300, 44 past the step).
                       Case{6, 520, 8, 16, 2, DType::f32, DType::bf16, true, 0},
                       Case{6, 300, 8, 24, 2, DType::f32, DType::f32, false, 1},
                       Case{1, 33, 7, 9, 3, DType::f64, DType::f64, false, 0}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.T << " D " << c.D << " " << dtype_name(c.x)
                                      << " weights " << dtype_name(c.w) << (c.rb ? " bf16" : ""));
    const ExpertCase m = make_experts(c.T, c.D, c.E, c.I, c.K, 8, c.x, c.skew, rng);
    const Tensor gu = m.gate_up.to(c.w), dn = m.down.to(c.w);
    const Tensor want = ops::moe_routed_experts(m.x.ref, gu, dn, m.idx, 1.5, c.rb);
    const Tensor dgu = gpu(gu), ddn = gpu(dn), didx = gpu(m.idx);
    reset_transfer_stats();
    const Tensor got = ops::moe_routed_experts(m.x.dev, dgu, ddn, didx, 1.5, c.rb);
    EXPECT_EQ(transfer_stats().to_host, 0u) << "the host waited for the device";
    const Tensor h = cpu(got);
    EXPECT_LE(gpu_compare::max_rel_err(h, want), c.x == DType::f64 ? 1e-14 : 1e-6);
    const std::vector<double> hv = h.to_f64_vector(), wv = want.to_f64_vector();
    for (size_t i = 0; i < hv.size(); ++i) equal += hv[i] == wv[i];
    total += int64_t(hv.size());
    EXPECT_TRUE(
        testing::bit_equal(cpu(ops::moe_routed_experts(m.x.dev, dgu, ddn, didx, 1.5, c.rb)), h))
        << "rerun";
    // Each token alone: the same bits as in the batch.
    for (int64_t t = 0; t < c.T; t += std::max<int64_t>(1, c.T / 4)) {
      const Tensor one = cpu(ops::moe_routed_experts(m.x.dev.slice(0, t, t + 1), dgu, ddn,
                                                     didx.slice(0, t, t + 1), 1.5, c.rb));
      ASSERT_TRUE(testing::bit_equal(one, h.slice(0, t * c.K, (t + 1) * c.K))) << "token " << t;
    }
  }
  std::printf("  routed experts: %lld of %lld CUDA outputs equal the CPU's bits\n",
              static_cast<long long>(equal), static_cast<long long>(total));
  // An index outside [0, E), not read on the host: its row is NaN, the others as before.
  const ExpertCase m = make_experts(3, 16, 4, 8, 2, 8, DType::f32, 0, rng);
  std::vector<int64_t> iv = m.idx.to_i64_vector();
  iv[3] = 4;
  const Tensor bad = Tensor::from_vector<int64_t>({3, 2}, iv);
  const Tensor ref =
      cpu(ops::moe_routed_experts(m.x.dev, gpu(m.gate_up), gpu(m.down), gpu(m.idx), 10, false));
  const Tensor got = cpu(ops::moe_routed_experts(m.x.dev, gpu(m.gate_up), gpu(m.down),
                                                 gpu(bad.to(DType::i32)), 10, false));
  for (int64_t a = 0; a < 6; ++a)
    for (int64_t d = 0; d < 16; ++d) {
      if (a == 3)
        ASSERT_TRUE(std::isnan(got.at({a, d})));
      else
        ASSERT_EQ(got.at({a, d}), ref.at({a, d})) << a << " " << d;
    }
}

TEST(MoeGpu, BadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const auto c = router_cfg(8, 2);
  const Tensor logits = gpu(randn({3, 8}, DType::f32, rng));
  EXPECT_NO_THROW(ops::moe_router_forward(logits, Tensor(), c));
  testing::expect_error(
      [&] {
        ops::moe_router_forward(gpu(randn({3, 8}, DType::bf16, rng)), Tensor(), c);
      },
      "logits must be f32 or f64");
  testing::expect_error([&] { ops::moe_router_forward(logits, randn({8}, DType::f32, rng), c); },
                        "bias must be on the device of logits");
  const Tensor dup = gpu(Tensor::from_vector<int64_t>({3, 2}, {0, 1, 2, 2, 4, 5}));
  testing::expect_error([&] { ops::moe_router_forward(logits, Tensor(), c, dup); }, "repeats");
  const Tensor oob = gpu(Tensor::from_vector<int64_t>({3, 2}, {0, 1, 2, 8, 4, 5}));
  testing::expect_error([&] { ops::moe_expert_load(oob, 8); }, "outside [0, 8)");
  Tensor bias = gpu(randn({8}, DType::f32, rng));
  testing::expect_error([&] { ops::moe_bias_update(bias, gpu(randn({7}, DType::f32, rng)), 1e-3); },
                        "load must have shape");
  testing::expect_error(
      [&] {
        ops::swiglu_clamped_forward(gpu(randn({3, 5}, DType::f32, rng)), 1);
      },
      "gu must be [..., 2I]");
  const Tensor eo = gpu(randn({4, 2, 3}, DType::bf16, rng));
  testing::expect_error(
      [&] {
        ops::moe_combine(eo, gpu(randn({4, 2}, DType::f64, rng)));
      },
      "w must have the dtype of eo (bf16) or f32");
  testing::expect_error(
      [&] {
        ops::moe_combine(eo, randn({4, 2}, DType::f32, rng));
      },
      "w must be on the device of eo");
  const ExpertCase m = make_experts(4, 8, 4, 4, 2, 4, DType::f32, 0, rng);
  const ops::MoeWeights wg{gpu(m.gate_up), gpu(m.down), gpu(m.sgu), gpu(m.sdown)};
  ops::MoeSaved s;
  testing::expect_error([&] { ops::moe_experts_forward(m.x.dev, wg, m.idx, gpu(m.w), 10.0, s); },
                        "topk_idx must be on the device of x");
  const Tensor oob4 = gpu(Tensor::from_vector<int64_t>({4, 2}, {0, 1, 2, 3, 4, 0, 1, 2}));
  testing::expect_error([&] { ops::moe_experts_forward(m.x.dev, wg, oob4, gpu(m.w), 10.0, s); },
                        "outside [0, 4)");
  ops::moe_experts_forward(m.x.dev, wg, gpu(m.idx), gpu(m.w), 10.0, s);
  ops::MoeWeightGrads g{gpu(Tensor::zeros(m.gate_up.shape(), DType::f32)),
                        Tensor::zeros(m.down.shape(), DType::f32),
                        gpu(Tensor::zeros(m.sgu.shape(), DType::f32)),
                        gpu(Tensor::zeros(m.sdown.shape(), DType::f32))};
  testing::expect_error(
      [&] {
        ops::moe_experts_backward(s, wg, gpu(randn({4, 8}, DType::f32, rng)), g);
      },
      "g.ddown must be on the device of x");
}

}  // namespace
}  // namespace hlm
