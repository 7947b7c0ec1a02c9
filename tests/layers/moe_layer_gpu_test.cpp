// The MoE layer (layers/moe/moe_layer.h) on CUDA, where its routed experts run as two grouped GEMMs
// (ops::gemm_grouped) around one SwiGLU, against the same module on the CPU (one Linear per
// expert): T = 45 tokens in two sequences, 8 experts top-2 (experts without tokens included), a
// shared expert, the aux loss on, the clamp active on part of the activations, plain and recompute
// contexts.
//   f32 parameters, native GEMMs: y, dx and every gradient within 2e-5 of the largest reference
//     value, the aux loss within 1e-6 relative, the selection identical;
//   bf16 parameters, bf16 GEMMs: y, dx and every gradient within 3e-3 relative L2 (the operands
//     are the same bf16 values; only the summation order and the roundings that follow differ).
// Reruns are bit-identical.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/rng.h"
#include "layers/moe/moe_layer.h"
#include "ops/gpu_compare.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

// 8 experts top-2 of 16 channels, a shared expert, the clamp active on part of the activations.
MoeConfig small_config(DType dt, uint64_t seed) {
  MoeConfig c;
  c.hidden_size = 32;
  c.n_experts = 8;
  c.top_k = 2;
  c.moe_intermediate_size = 16;
  c.n_shared_experts = 1;
  c.swiglu_limit = 1.5;
  c.aux_loss_coeff = 1e-2;
  c.dtype = dt;
  c.seed = seed;
  c.init_std = 0.3;
  return c;
}

// bf16 GEMMs for bf16 parameters, native ones for f32.
PrecisionPolicy policy_for(DType dt) {
  PrecisionPolicy pol;
  pol.default_kind = dt == DType::bf16 ? GemmKind::bf16 : GemmKind::native;
  return pol;
}

TEST(MoeLayerGpu, GroupedExpertsMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (DType dt : {DType::f32, DType::bf16}) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (recompute ? " recompute" : ""));
      const MoeConfig c = small_config(dt, 3);
      MoeLayer ref(c, policy_for(dt), "model.layers.1.mlp"),
          dev(c, policy_for(dt), "model.layers.1.mlp");
      // Route every token away from expert 7: an expert without tokens.
      {
        std::vector<double> b(8, 0.0);
        b[7] = -100.0;
        ref.correction_bias().value =
            Tensor::from_values({8}, b, ref.correction_bias().value.dtype());
        dev.correction_bias().value = ref.correction_bias().value.clone();
      }
      dev.to(Device::cuda);
      Rng rng(testing::test_seed(), 97);
      const Tensor x = randn({45, 32}, DType::f32, rng).to(dt);
      const Tensor dy = randn({45, 32}, DType::f32, rng).to(dt);
      const SeqLayout seqs = SeqLayout::from_lengths({30, 15});
      Context ctx;
      ctx.recompute = recompute;
      struct Run {
        Tensor y, dx, idx;
        double aux = 0;
      };
      auto run = [&](MoeLayer& m, const Tensor& xx, const Tensor& dyy) {
        MoeLayer::Saved s;
        m.zero_grad();
        const MoeLayer::Output o = m.forward(ctx, xx, seqs, &s);
        Run r{cpu(o.y), Tensor(), cpu(o.topk_idx), o.aux_loss};
        r.dx = cpu(m.backward(ctx, dyy, s, 1.0));
        return r;
      };
      const Run rc = run(ref, x, dy);
      const Run rg = run(dev, gpu(x), gpu(dy));
      EXPECT_TRUE(testing::bit_equal(rg.idx, rc.idx)) << "selection";
      for (int64_t t = 0; t < 45; ++t)
        for (int64_t k = 0; k < 2; ++k)
          ASSERT_NE(rc.idx.to(DType::i64).data<int64_t>()[t * 2 + k], 7);
      auto pc = ref.named_parameters(), pg = dev.named_parameters();
      ASSERT_EQ(pc.size(), pg.size());
      if (dt == DType::f32) {
        EXPECT_LE(gpu_compare::max_rel_err(rg.y, rc.y), 2e-5) << "y";
        EXPECT_LE(gpu_compare::max_rel_err(rg.dx, rc.dx), 2e-5) << "dx";
        EXPECT_NEAR(rg.aux, rc.aux, 1e-6 * std::fabs(rc.aux)) << "aux loss";
        for (size_t i = 0; i < pc.size(); ++i) {
          if (!pc[i].second->grad.defined()) continue;  // the correction bias has none
          EXPECT_LE(gpu_compare::max_rel_err(cpu(pg[i].second->grad), pc[i].second->grad), 2e-5)
              << pc[i].first;
        }
      } else {
        auto rel = [](const Tensor& a, const Tensor& b) {
          return testing::compare(a.to(DType::f64), b.to(DType::f64)).rel_l2;
        };
        EXPECT_LE(rel(rg.y, rc.y), 3e-3) << "y";
        EXPECT_LE(rel(rg.dx, rc.dx), 3e-3) << "dx";
        for (size_t i = 0; i < pc.size(); ++i) {
          if (!pc[i].second->grad.defined()) continue;
          EXPECT_LE(rel(cpu(pg[i].second->grad), pc[i].second->grad), 3e-3) << pc[i].first;
        }
      }
      // The expert without tokens gets a zero gradient on both devices.
      const Tensor gu_grad = cpu(dev.experts_gate_up().grad).to(DType::f64);
      const int64_t per = gu_grad.numel() / 8;
      for (int64_t i = 0; i < per; ++i) ASSERT_EQ(gu_grad.data<double>()[7 * per + i], 0.0);
      const Tensor g0 = cpu(dev.experts_gate_up().grad);
      const Run rg2 = run(dev, gpu(x), gpu(dy));
      EXPECT_TRUE(testing::bit_equal(rg.y, rg2.y));
      EXPECT_TRUE(testing::bit_equal(rg.dx, rg2.dx));
      EXPECT_TRUE(testing::bit_equal(g0, cpu(dev.experts_gate_up().grad)));
    }
  }
}

// Outside training, at decode sizes, the routed experts run through ops::moe_routed_experts: the
// layer's output is the CPU layer's (f32: 2e-5 of the largest value; bf16 GEMMs: 3e-3 relative
// L2), and without the aux loss the forward never waits for the device. Above the size limit the
// grouped GEMMs run, with the same numbers.
TEST(MoeLayerGpu, InferenceKeepsTheSelectionOnTheDevice) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const MoeConfig c = small_config(dt, 5);
    MoeLayer ref(c, policy_for(dt), "model.layers.1.mlp"),
        dev(c, policy_for(dt), "model.layers.1.mlp");
    dev.to(Device::cuda);
    Rng rng(testing::test_seed(), 98);
    const Context eval{false, false};
    // The limit is 16 x 8 = 128 rows (T K), 64 tokens; 100 tokens take the grouped GEMMs.
    for (const int64_t T : {int64_t(5), int64_t(64), int64_t(100)}) {
      const Tensor x = randn({T, 32}, DType::f32, rng);
      const SeqLayout seqs = SeqLayout::from_lengths({T});
      const Tensor yc = ref.forward(eval, x, seqs, nullptr).y;
      reset_transfer_stats();
      const Tensor yg = dev.forward(eval, gpu(x), seqs, nullptr, Tensor(), nullptr, false).y;
      const uint64_t waits = transfer_stats().to_host;
      if (T * 2 <= MoeLayer::kRoutedRowsPerExpert * 8)
        EXPECT_EQ(waits, 0u) << "T " << T << ": the host waited for the device";
      else
        EXPECT_GT(waits, 0u) << "T " << T << ": the grouped GEMMs read the selection";
      if (dt == DType::f32)
        EXPECT_LE(gpu_compare::max_rel_err(cpu(yg), yc), 2e-5) << "T " << T;
      else
        EXPECT_LE(testing::compare(cpu(yg).to(DType::f64), yc.to(DType::f64)).rel_l2, 3e-3)
            << "T " << T;
    }
  }
}

}  // namespace
}  // namespace hlm
