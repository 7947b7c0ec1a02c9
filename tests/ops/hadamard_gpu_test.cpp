// CUDA Hadamard rotation (ops::hadamard / hadamard_inplace) against the CPU op on the same inputs:
// f32 and f64 bit-identical to the CPU (the same butterflies in the same order), bf16 within
// relative L2 2e-3 of the CPU f32 op on the bf16-rounded inputs; d from 1 to 8192 (register and
// shared-memory kernels, f64 8192 past 48 KB), rows 1 / 63 / 65 and [T, H, d]; outputs
// NaN-poisoned, in place == out of place, two runs bit-identical, twice == identity, bad arguments
// refused.
#include <gtest/gtest.h>

#include "gpu_compare.h"
#include "ops/dispatch.h"
#include "ops/hadamard.h"

namespace hlm {
namespace {

using gpu_compare::check;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::cpu;
using testing::gpu;

TEST(HadamardGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t d : {1, 4, 32, 64, 128, 1024, 2048, 8192})
      for (int64_t rows : {1, 63, 65}) {
        if ((d >= 1024 && rows == 65) || (d == 8192 && rows != 1)) continue;
        const Pair x = make({rows, d}, dt, rng);
        const Tensor ref = ops::hadamard(x.ref);
        const Tensor y = ops::hadamard(x.dev);
        std::printf("hadamard rows=%lld d=%lld\n", (long long)rows, (long long)d);
        check("hadamard", y, ref, dt);
        if (dt != DType::bf16) {
          EXPECT_TRUE(testing::bit_equal(cpu(y), ref)) << "d=" << d << " rows=" << rows;
        }
        EXPECT_TRUE(testing::bit_equal(cpu(ops::hadamard(x.dev)), cpu(y)));
        Tensor xi = x.dev.clone();
        ops::hadamard_inplace(xi);
        EXPECT_TRUE(testing::bit_equal(cpu(xi), cpu(y)));
        if (dt != DType::bf16) check("hadamard twice", ops::hadamard(y), x.ref, dt);
      }
  // [T, H, d] rows.
  const Pair x3 = make({7, 3, 128}, DType::f32, rng);
  EXPECT_TRUE(testing::bit_equal(cpu(ops::hadamard(x3.dev)), ops::hadamard(x3.ref)));
}

TEST(HadamardGpu, BadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  EXPECT_THROW(ops::hadamard(gpu(randn({4, 12}, DType::f32, rng))), Error);
  EXPECT_THROW(ops::hadamard(gpu(Tensor::zeros({4, 8}, DType::i64))), Error);
  Tensor xt = gpu(randn({8, 4}, DType::f32, rng)).transpose(0, 1);
  EXPECT_THROW(ops::hadamard(xt), Error);  // CUDA inputs must be contiguous
}

}  // namespace
}  // namespace hlm
