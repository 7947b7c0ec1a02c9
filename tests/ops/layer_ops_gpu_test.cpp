// CUDA layer ops (conv1d, RMSNorm / gated RMSNorm, L2 norm, KDA gate, activations) against the
// CPU ops on the same inputs: f32 (max error / max |ref| <= 2e-5), f64, bf16 (relative L2 <= 3e-3
// against the CPU f32 op on the bf16-rounded inputs), odd sizes, outputs NaN-poisoned,
// bit-identical run to run, packed conv == its sequences one by one. Every comparison prints its
// errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "gpu_compare.h"
#include "ops/activations.h"
#include "ops/conv1d.h"
#include "ops/dispatch.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/rmsnorm.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

using Poison = testing::PoisonOutputs;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::cpu;
using testing::gpu;
// Checks a GPU output (any dtype) against a CPU reference (bf16: relative L2 <= 3e-3); prints the
// errors.
void check(const char* what, const Tensor& out_gpu, const Tensor& ref, DType dt) {
  gpu_compare::check(what, out_gpu, ref, dt, 3e-3);
}

TEST(LayerOpsGpuConv1d, ForwardBackwardUpdate) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  const std::vector<std::vector<int64_t>> cases = {
      {1}, {63}, {65}, {1000}, {5, 0, 1, 1, 300, 2, 0, 7}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const auto& lens : cases)
      for (int64_t C : {37, 64})
        for (int64_t W : {4, 3}) {
          const SeqLayout cu = SeqLayout::from_lengths(lens);
          int64_t T = 0;
          for (int64_t l : lens) T += l;
          const int64_t N = int64_t(lens.size());
          const bool silu = W == 4;
          Pair x = make({T, C}, dt, rng), w = make({C, W}, dt, rng, 0.5);
          Pair s0 = make({N, W - 1, C}, dt, rng), dy = make({T, C}, dt, rng);
          Tensor fin_ref, fin_dev;
          const Tensor y_ref = ops::causal_conv1d_forward(x.ref, w.ref, cu, s0.ref, silu, &fin_ref);
          const Tensor y_dev = ops::causal_conv1d_forward(x.dev, w.dev, cu, s0.dev, silu, &fin_dev);
          std::printf("conv T=%lld C=%lld W=%lld N=%lld\n", (long long)T, (long long)C,
                      (long long)W, (long long)N);
          check("conv fwd y", y_dev, y_ref, dt);
          check("conv fwd final_state", fin_dev, fin_ref, dt);
          const Tensor w_base = randn({C, W}, dt == DType::f64 ? DType::f64 : DType::f32, rng);
          Tensor dw_ref = w_base.clone(), dw_dev = gpu(w_base);  // f32 dw next to bf16 x
          const auto g_ref =
              ops::causal_conv1d_backward(dy.ref, x.ref, w.ref, cu, s0.ref, silu, dw_ref);
          const auto g_dev =
              ops::causal_conv1d_backward(dy.dev, x.dev, w.dev, cu, s0.dev, silu, dw_dev);
          check("conv bwd dx", g_dev.dx, g_ref.dx, dt);
          check("conv bwd dinitial_state", g_dev.dinitial_state, g_ref.dinitial_state, dt);
          check("conv bwd dw", dw_dev, dw_ref, dt == DType::bf16 ? DType::bf16 : dt);
          // Run twice: same bits.
          Tensor dw2 = gpu(w_base);
          const auto g2 = ops::causal_conv1d_backward(dy.dev, x.dev, w.dev, cu, s0.dev, silu, dw2);
          const Tensor y2 = ops::causal_conv1d_forward(x.dev, w.dev, cu, s0.dev, silu);
          EXPECT_TRUE(testing::bit_equal(cpu(y2), cpu(y_dev)));
          EXPECT_TRUE(testing::bit_equal(cpu(g2.dx), cpu(g_dev.dx)));
          EXPECT_TRUE(testing::bit_equal(cpu(dw2), cpu(dw_dev)));
          // Packed == one by one (y, dx, and dw accumulated sequence by sequence).
          if (lens.size() > 1) {
            Tensor dw_sep = gpu(w_base);
            int64_t bos = 0;
            const Tensor xc = cpu(x.dev), dyc = cpu(dy.dev), sc = cpu(s0.dev);
            const Tensor yc = cpu(y_dev), dxc = cpu(g_dev.dx);
            for (size_t n = 0; n < lens.size(); ++n) {
              const int64_t L = lens[n];
              const SeqLayout cu1 = SeqLayout::from_lengths({L});
              const Tensor xn = gpu(xc.slice(0, bos, bos + L).contiguous());
              const Tensor dyn = gpu(dyc.slice(0, bos, bos + L).contiguous());
              const Tensor sn = gpu(sc.slice(0, int64_t(n), int64_t(n) + 1).contiguous());
              const Tensor yn = ops::causal_conv1d_forward(xn, w.dev, cu1, sn, silu);
              const auto gn = ops::causal_conv1d_backward(dyn, xn, w.dev, cu1, sn, silu, dw_sep);
              EXPECT_TRUE(testing::bit_equal(cpu(yn), yc.slice(0, bos, bos + L).contiguous()));
              EXPECT_TRUE(testing::bit_equal(cpu(gn.dx), dxc.slice(0, bos, bos + L).contiguous()));
              bos += L;
            }
            EXPECT_TRUE(testing::bit_equal(cpu(dw_sep), cpu(dw_dev))) << "packed dw";
          }
          // Decode step from the final state.
          Pair xt = make({N, C}, dt, rng);
          Tensor st_ref = fin_ref.clone(), st_dev = fin_dev.clone();
          const Tensor u_ref = ops::causal_conv1d_update(xt.ref, st_ref, w.ref, silu);
          const Tensor u_dev = ops::causal_conv1d_update(xt.dev, st_dev, w.dev, silu);
          check("conv update y", u_dev, u_ref, dt);
          check("conv update state", st_dev, st_ref, dt);
          // The same step through slots of a pool (rows N+1 .. 2N in reverse order): the bits
          // of the plain step, the pool's other rows untouched.
          Tensor pool = Tensor::zeros({2 * N + 1, W - 1, C}, xt.dev.dtype(), Device::cuda);
          std::vector<int64_t> slots;
          for (int64_t i = 0; i < N; ++i) slots.push_back(2 * N - i);
          Tensor st_slots = fin_dev.clone();
          for (int64_t i = 0; i < N; ++i) {
            Tensor row = pool.slice(0, slots[size_t(i)], slots[size_t(i)] + 1);
            ops::copy_into(row, st_slots.slice(0, i, i + 1));
          }
          const Tensor u_slots = ops::causal_conv1d_update_slots(xt.dev, pool, slots, w.dev, silu);
          EXPECT_TRUE(testing::bit_equal(cpu(u_slots), cpu(u_dev)));
          const Tensor pc = cpu(pool), sc = cpu(st_dev);
          for (int64_t i = 0; i < N; ++i)
            EXPECT_TRUE(testing::bit_equal(pc.slice(0, slots[size_t(i)], slots[size_t(i)] + 1),
                                           sc.slice(0, i, i + 1)));
          for (int64_t r = 0; r <= N; ++r)
            EXPECT_EQ(pc.slice(0, r, r + 1).to_f64_vector(),
                      std::vector<double>(size_t((W - 1) * C), 0.0));
        }
}

TEST(LayerOpsGpuNorm, RmsGatedL2) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t rows : {1, 63, 65, 1000})
      for (int64_t D : {128, 37, 4100}) {
        if (rows == 1000 && D == 4100) continue;
        std::printf("norm rows=%lld D=%lld\n", (long long)rows, (long long)D);
        const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
        Pair x = make({rows, D}, dt, rng), g = make({rows, D}, dt, rng, 2.0);
        Pair dy = make({rows, D}, dt, rng);
        // w: f32 next to bf16 x (an FP32 parameter), dw f32.
        const Tensor wc = rand_uniform({D}, cdt, rng, 0.5, 1.5);
        const Tensor w_ref = wc, w_dev = gpu(wc);
        const Tensor dw0 = randn({D}, cdt, rng);
        // plain
        auto f_ref = ops::rmsnorm_forward(x.ref, w_ref, 1e-6);
        auto f_dev = ops::rmsnorm_forward(x.dev, w_dev, 1e-6);
        check("rmsnorm y", f_dev.y, f_ref.y, dt);
        check("rmsnorm rstd", f_dev.rstd, f_ref.rstd, cdt);
        Tensor dw_ref = dw0.clone(), dw_dev = gpu(dw0);
        const Tensor dx_ref = ops::rmsnorm_backward(dy.ref, x.ref, w_ref, f_ref.rstd, dw_ref);
        const Tensor dx_dev = ops::rmsnorm_backward(dy.dev, x.dev, w_dev, f_dev.rstd, dw_dev);
        check("rmsnorm dx", dx_dev, dx_ref, dt);
        check("rmsnorm dw", dw_dev, dw_ref, dt);
        // gated
        auto gf_ref = ops::gated_rmsnorm_forward(x.ref, g.ref, w_ref, 1e-5);
        auto gf_dev = ops::gated_rmsnorm_forward(x.dev, g.dev, w_dev, 1e-5);
        check("gated rmsnorm y", gf_dev.y, gf_ref.y, dt);
        Tensor gdw_ref = dw0.clone(), gdw_dev = gpu(dw0);
        const auto gb_ref =
            ops::gated_rmsnorm_backward(dy.ref, x.ref, g.ref, w_ref, gf_ref.rstd, gdw_ref);
        const auto gb_dev =
            ops::gated_rmsnorm_backward(dy.dev, x.dev, g.dev, w_dev, gf_dev.rstd, gdw_dev);
        check("gated rmsnorm dx", gb_dev.dx, gb_ref.dx, dt);
        check("gated rmsnorm dgate", gb_dev.dgate, gb_ref.dgate, dt);
        check("gated rmsnorm dw", gdw_dev, gdw_ref, dt);
        Tensor gdw2 = gpu(dw0);
        const auto gb2 =
            ops::gated_rmsnorm_backward(dy.dev, x.dev, g.dev, w_dev, gf_dev.rstd, gdw2);
        EXPECT_TRUE(testing::bit_equal(cpu(gb2.dx), cpu(gb_dev.dx)));
        EXPECT_TRUE(testing::bit_equal(cpu(gdw2), cpu(gdw_dev)));
        // l2
        auto l_ref = ops::l2norm_forward(x.ref, 1e-6);
        auto l_dev = ops::l2norm_forward(x.dev, 1e-6);
        check("l2norm y", l_dev.y, l_ref.y, dt);
        const Tensor ldx_ref = ops::l2norm_backward(dy.ref, x.ref, l_ref.rstd);
        const Tensor ldx_dev = ops::l2norm_backward(dy.dev, x.dev, l_dev.rstd);
        check("l2norm dx", ldx_dev, ldx_ref, dt);
        EXPECT_TRUE(
            testing::bit_equal(cpu(ops::l2norm_backward(dy.dev, x.dev, l_dev.rstd)), cpu(ldx_dev)));
      }
}

TEST(LayerOpsGpuGate, StandardAndLowerBound) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t T : {1, 63, 65, 1000})
      for (auto kind : {ops::KdaGateKind::standard, ops::KdaGateKind::lower_bound}) {
        const int64_t HV = 3, K = 40;
        const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
        std::printf("gate T=%lld %s\n", (long long)T,
                    kind == ops::KdaGateKind::standard ? "standard" : "lower_bound");
        Pair z = make({T, HV, K}, dt, rng, 3.0);
        ops::KdaGateArgs ar, ad;
        ar.kind = ad.kind = kind;
        ar.z = z.ref, ad.z = z.dev;
        ar.A_log = rand_uniform({HV}, cdt, rng, -1, 1.5);
        ar.dt_bias = randn({HV * K}, cdt, rng);
        ad.A_log = gpu(ar.A_log), ad.dt_bias = gpu(ar.dt_bias);
        ar.lower_bound = ad.lower_bound = -4.0;
        check("gate g", ops::kda_gate(ad), ops::kda_gate(ar), cdt);
        const Tensor dg = randn({T, HV, K}, cdt, rng);
        const auto r_ref = ops::kda_gate_backward(ar, dg);
        const auto r_dev = ops::kda_gate_backward(ad, gpu(dg));
        check("gate dz", r_dev.dz, r_ref.dz, cdt);
        check("gate dA_log", r_dev.dA_log, r_ref.dA_log, cdt);
        check("gate ddt_bias", r_dev.ddt_bias, r_ref.ddt_bias, cdt);
        const auto r2 = ops::kda_gate_backward(ad, gpu(dg));
        EXPECT_TRUE(testing::bit_equal(cpu(r2.dA_log), cpu(r_dev.dA_log)));
        EXPECT_TRUE(testing::bit_equal(cpu(r2.ddt_bias), cpu(r_dev.ddt_bias)));
      }
  // Saturation: huge exp(A_log) and |z|: no NaN, as on the CPU.
  ops::KdaGateArgs ar;
  ar.z = Tensor::from_vector<float>({2, 1, 4}, {1e4f, -1e4f, 0.f, 30.f, -30.f, 80.f, -80.f, 5.f});
  ar.A_log = Tensor::from_vector<float>({1}, {88.f});
  ar.dt_bias = Tensor::zeros({4}, DType::f32);
  for (auto kind : {ops::KdaGateKind::standard, ops::KdaGateKind::lower_bound}) {
    ar.kind = kind;
    ops::KdaGateArgs ad = ar;
    ad.z = gpu(ar.z), ad.A_log = gpu(ar.A_log), ad.dt_bias = gpu(ar.dt_bias);
    const Tensor dg = Tensor::full({2, 1, 4}, 1.0, DType::f32);
    const auto r_ref = ops::kda_gate_backward(ar, dg);
    const auto r_dev = ops::kda_gate_backward(ad, gpu(dg));
    for (double v : cpu(r_dev.dz).to_f64_vector()) EXPECT_FALSE(std::isnan(v));
    for (double v : cpu(r_dev.dA_log).to_f64_vector()) EXPECT_FALSE(std::isnan(v));
    EXPECT_EQ(testing::compare(cpu(r_dev.dz), r_ref.dz).nan_mismatch, 0);
  }
}

TEST(LayerOpsGpuActivation, SigmoidSiluSoftplus) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t n : {1, 63, 1000, 4099}) {
      std::printf("activations n=%lld\n", (long long)n);
      Pair x = make({n}, dt, rng, 6.0), dy = make({n}, dt, rng);
      check("sigmoid", ops::sigmoid_forward(x.dev), ops::sigmoid_forward(x.ref), dt);
      check("sigmoid bwd", ops::sigmoid_backward(x.dev, dy.dev),
            ops::sigmoid_backward(x.ref, dy.ref), dt);
      check("silu", ops::silu_forward(x.dev), ops::silu_forward(x.ref), dt);
      check("silu bwd", ops::silu_backward(x.dev, dy.dev), ops::silu_backward(x.ref, dy.ref), dt);
      check("softplus", ops::softplus_forward(x.dev), ops::softplus_forward(x.ref), dt);
      check("softplus bwd", ops::softplus_backward(x.dev, dy.dev),
            ops::softplus_backward(x.ref, dy.ref), dt);
    }
}

}  // namespace
}  // namespace hlm
