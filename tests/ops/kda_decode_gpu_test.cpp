// KDA decode on CUDA vs the CPU implementation on the same inputs (f32 and bf16 inputs, GVA,
// fused L2 norm, a state pool with skipped sequences), and bit-identical run to run.
#include <gtest/gtest.h>

#include "ops/kda_decode.h"
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
    }
}

}  // namespace
}  // namespace hlm
