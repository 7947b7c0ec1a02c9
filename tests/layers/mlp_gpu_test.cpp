// The dense SwiGLU MLP (layers/mlp.h) on CUDA against the same module on the CPU: f32 parameters
// with native GEMMs (y, dx and every weight gradient within 2e-5 of the largest reference value)
// and bf16 parameters with bf16 GEMMs and bf16 x (within 3e-3 relative L2), the clamp active on
// part of the activations, normal and recompute contexts; reruns bit-identical; the wrong device
// refused.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/rng.h"
#include "layers/mlp.h"
#include "ops/gpu_compare.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

TEST(DenseMlpGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (DType dt : {DType::f32, DType::bf16}) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (recompute ? " recompute" : ""));
      DenseMlpConfig c;
      c.hidden_size = 64;
      c.intermediate_size = 48;
      c.swiglu_limit = 1.5;  // clamps part of the activations
      c.dtype = dt;
      c.seed = 5;
      c.init_std = 0.25;
      PrecisionPolicy pol;
      pol.default_kind = dt == DType::bf16 ? GemmKind::bf16 : GemmKind::native;
      DenseMlp ref(c, pol, "model.layers.0.mlp"), dev(c, pol, "model.layers.0.mlp");
      dev.to(Device::cuda);
      Rng rng(testing::test_seed(), 95);
      const Tensor x = randn({77, 64}, DType::f32, rng).to(dt);
      const Tensor dy = randn({77, 64}, DType::f32, rng).to(dt);
      Context ctx;
      ctx.recompute = recompute;
      auto run = [&](DenseMlp& m, const Tensor& xx, const Tensor& dyy, Tensor& y, Tensor& dx) {
        DenseMlp::Saved s;
        m.zero_grad();
        y = cpu(m.forward(ctx, xx, &s));
        dx = cpu(m.backward(ctx, dyy, s));
      };
      Tensor yc, dxc, yg, dxg, yg2, dxg2;
      run(ref, x, dy, yc, dxc);
      run(dev, gpu(x), gpu(dy), yg, dxg);
      auto pc = ref.named_parameters(), pg = dev.named_parameters();
      if (dt == DType::f32) {
        EXPECT_LE(gpu_compare::max_rel_err(yg, yc), 2e-5) << "y";
        EXPECT_LE(gpu_compare::max_rel_err(dxg, dxc), 2e-5) << "dx";
        for (size_t i = 0; i < pc.size(); ++i)
          EXPECT_LE(gpu_compare::max_rel_err(cpu(pg[i].second->grad), pc[i].second->grad), 2e-5)
              << pc[i].first;
      } else {
        auto rel = [](const Tensor& a, const Tensor& b) {
          return testing::compare(a.to(DType::f64), b.to(DType::f64)).rel_l2;
        };
        EXPECT_LE(rel(yg, yc), 3e-3) << "y";
        EXPECT_LE(rel(dxg, dxc), 3e-3) << "dx";
        for (size_t i = 0; i < pc.size(); ++i)
          EXPECT_LE(rel(cpu(pg[i].second->grad), pc[i].second->grad), 3e-3) << pc[i].first;
      }
      const Tensor g0 = cpu(pg[0].second->grad);
      run(dev, gpu(x), gpu(dy), yg2, dxg2);
      EXPECT_TRUE(testing::bit_equal(yg, yg2));
      EXPECT_TRUE(testing::bit_equal(dxg, dxg2));
      EXPECT_TRUE(testing::bit_equal(g0, cpu(pg[0].second->grad)));
    }
  }
}

TEST(DenseMlpGpu, WrongDeviceRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  DenseMlpConfig c;
  c.hidden_size = 8;
  c.intermediate_size = 4;
  DenseMlp dev(c, PrecisionPolicy{}, "mlp");
  dev.to(Device::cuda);
  Rng rng(testing::test_seed(), 96);
  const Tensor x = randn({3, 8}, DType::f32, rng);
  DenseMlp::Saved s;
  testing::expect_error([&] { dev.forward(Context{}, x, &s); }, "on the parameters' device");
  dev.forward(Context{}, gpu(x), &s);
  testing::expect_error([&] { dev.backward(Context{}, x, s); }, "on x's device");
}

}  // namespace
}  // namespace hlm
