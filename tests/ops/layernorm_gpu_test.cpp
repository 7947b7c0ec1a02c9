// CUDA LayerNorm (ops::layernorm_forward / backward) against the CPU op on the same inputs: f32,
// f64, bf16 x (f32 parameters and gradients), rows 1 / 63 / 65, warp rows and block rows
// (D > 2048), odd D; outputs NaN-poisoned, two runs bit-identical, bad arguments refused.
#include <gtest/gtest.h>

#include "gpu_compare.h"
#include "ops/dispatch.h"
#include "ops/layernorm.h"

namespace hlm {
namespace {

using gpu_compare::check;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::cpu;
using testing::gpu;

TEST(LayerNormGpu, ForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t rows : {1, 63, 65})
      for (int64_t D : {64, 37, 2100}) {
        std::printf("layernorm %s rows=%lld D=%lld\n", dtype_name(dt), (long long)rows,
                    (long long)D);
        const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
        // Off-centre inputs, so that the mean matters.
        const Tensor xc = rand_uniform({rows, D}, cdt, rng, -1.0, 3.0);
        const Pair x = dt == DType::bf16 ? Pair{testing::round_bf16(xc), gpu(xc.to(DType::bf16))}
                                         : Pair{xc, gpu(xc)};
        const Pair dy = make({rows, D}, dt, rng);
        const Tensor w = rand_uniform({D}, cdt, rng, 0.5, 1.5), b = randn({D}, cdt, rng);
        const Tensor dw0 = randn({D}, cdt, rng), db0 = randn({D}, cdt, rng);
        const auto f_ref = ops::layernorm_forward(x.ref, w, b, 1e-5);
        const auto f_dev = ops::layernorm_forward(x.dev, gpu(w), gpu(b), 1e-5);
        check("layernorm y", f_dev.y, f_ref.y, dt);
        check("layernorm mean", f_dev.mean, f_ref.mean, cdt);
        check("layernorm rstd", f_dev.rstd, f_ref.rstd, cdt);
        Tensor dw_ref = dw0.clone(), db_ref = db0.clone(), dw_dev = gpu(dw0), db_dev = gpu(db0);
        const Tensor dx_ref =
            ops::layernorm_backward(dy.ref, x.ref, w, f_ref.mean, f_ref.rstd, dw_ref, db_ref);
        const Tensor dx_dev =
            ops::layernorm_backward(dy.dev, x.dev, gpu(w), f_dev.mean, f_dev.rstd, dw_dev, db_dev);
        check("layernorm dx", dx_dev, dx_ref, dt);
        check("layernorm dw", dw_dev, dw_ref, dt);
        check("layernorm db", db_dev, db_ref, dt);
        // Run to run: bit-identical.
        const auto f2 = ops::layernorm_forward(x.dev, gpu(w), gpu(b), 1e-5);
        EXPECT_TRUE(testing::bit_equal(cpu(f2.y), cpu(f_dev.y)));
        EXPECT_TRUE(testing::bit_equal(cpu(f2.rstd), cpu(f_dev.rstd)));
        Tensor dw2 = gpu(dw0), db2 = gpu(db0);
        const Tensor dx2 =
            ops::layernorm_backward(dy.dev, x.dev, gpu(w), f_dev.mean, f_dev.rstd, dw2, db2);
        EXPECT_TRUE(testing::bit_equal(cpu(dx2), cpu(dx_dev)));
        EXPECT_TRUE(testing::bit_equal(cpu(dw2), cpu(dw_dev)));
        EXPECT_TRUE(testing::bit_equal(cpu(db2), cpu(db_dev)));
      }
}

TEST(LayerNormGpu, BadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = gpu(randn({4, 8}, DType::f32, rng)), w = gpu(randn({8}, DType::f32, rng));
  const Tensor wd = gpu(randn({8}, DType::f64, rng));
  EXPECT_THROW(ops::layernorm_forward(x, wd, w), Error);                                // dtypes
  EXPECT_THROW(ops::layernorm_forward(x, gpu(randn({7}, DType::f32, rng)), w), Error);  // shape
  EXPECT_THROW(ops::layernorm_forward(x, randn({8}, DType::f32, rng), w), Error);       // device
  EXPECT_THROW(ops::layernorm_forward(gpu(Tensor::zeros({4, 8}, DType::i64)), w, w), Error);
  const auto f = ops::layernorm_forward(x, w, w);
  Tensor dw = gpu(Tensor::zeros({8}, DType::f32)), db = gpu(Tensor::zeros({8}, DType::f64));
  EXPECT_THROW(ops::layernorm_backward(x, x, w, f.mean, f.rstd, dw, db), Error);
  Tensor db4 = gpu(Tensor::zeros({4}, DType::f32));
  EXPECT_THROW(ops::layernorm_backward(x, x, w, f.mean, f.rstd, dw, db4), Error);
  EXPECT_THROW(ops::layernorm_backward(x, x, w, f.rstd.view({2, 2}), f.rstd, dw, dw), Error);
}

}  // namespace
}  // namespace hlm
