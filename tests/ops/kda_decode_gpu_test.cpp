// KDA decode on CUDA vs the CPU implementation on the same inputs (f32 and bf16 inputs, GVA,
// fused L2 norm, a state pool with skipped sequences), bit-identical run to run, and q / k / v
// given as columns of wider rows equal to the contiguous ones.
#include <gtest/gtest.h>

#include "ops/kda_decode.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(KdaDecodeGpu, MatchesCpuAndIsDeterministic) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t K : {64, 128}) {
      const int64_t N = 7, H = 4, HV = 8, V = 160, P = 9;
      ops::KdaDecodeArgs c;
      c.q = randn({N, H, K}, dt, rng), c.k = randn({N, H, K}, dt, rng);
      c.v = randn({N, HV, V}, dt, rng);
      c.g = rand_uniform({N, HV, K}, DType::f32, rng, -5, -0.001);
      c.beta = rand_uniform({N, HV}, DType::f32, rng, 0.01, 0.99);
      c.state = randn({P, HV, K, V}, DType::f32, rng, 0.5);
      c.state_indices = Tensor::from_vector<int64_t>({N}, {3, 0, -1, 8, 5, 1, 7});
      c.use_qk_l2norm = true;
      ops::KdaDecodeArgs g = c;
      for (Tensor* t : {&g.q, &g.k, &g.v, &g.g, &g.beta, &g.state}) *t = t->to(Device::cuda);
      g.state_indices = c.state_indices;
      const Tensor pool0 = g.state.clone();
      Tensor o_cpu = ops::kda_decode_step(c);
      Tensor o_gpu = ops::kda_decode_step(g);
      EXPECT_TRUE(testing::close(o_gpu.to(Device::cpu), o_cpu, {2e-6, 1e-4}))
          << dtype_name(dt) << " K=" << K;
      EXPECT_TRUE(testing::close(g.state.to(Device::cpu), c.state, {2e-6, 1e-4}));
      // Again from the same state: bit-identical.
      ops::KdaDecodeArgs g2 = g;
      g2.state = pool0.clone();
      Tensor o2 = ops::kda_decode_step(g2);
      EXPECT_TRUE(testing::bit_equal(o2, o_gpu));
      EXPECT_TRUE(testing::bit_equal(g2.state, g.state));
      // q, k and v as columns of one wider row per token (the decode layer's conv output): the
      // same bits.
      const int64_t Cq = H * K, Cv = HV * V, C = 2 * Cq + Cv + 5;
      Tensor wide = Tensor::zeros({N, C}, dt, Device::cuda);
      ops::KdaDecodeArgs g3 = g;
      Tensor parts[3] = {wide.slice(1, 0, Cq), wide.slice(1, Cq, 2 * Cq),
                         wide.slice(1, 2 * Cq, 2 * Cq + Cv)};
      ops::copy_into(parts[0], g.q.view({N, Cq}));
      ops::copy_into(parts[1], g.k.view({N, Cq}));
      ops::copy_into(parts[2], g.v.view({N, Cv}));
      g3.q = parts[0].split_dim(1, K);
      g3.k = parts[1].split_dim(1, K);
      g3.v = parts[2].split_dim(1, V);
      g3.state = pool0.clone();
      EXPECT_TRUE(testing::bit_equal(ops::kda_decode_step(g3), o_gpu));
      EXPECT_TRUE(testing::bit_equal(g3.state, g.state));
    }
}

}  // namespace
}  // namespace hlm
