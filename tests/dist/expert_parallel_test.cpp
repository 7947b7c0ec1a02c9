// Expert parallelism (MoeLayer with ep_size > 1, Comm::alltoallv): the configuration and the
// experts a rank holds in this process, and the layer over 2 and 4 processes (`mpirun
// --oversubscribe`) through `hlm_dist_check --moe-ep`, whose ranks each run their own tokens and
// compare with one layer of every expert run on all ranks' tokens (tests/dist/dist_check.cpp).
#include <gtest/gtest.h>

#include <string>

#include "dist/comm.h"
#include "layers/moe/moe_layer.h"
#include "testing.h"

namespace hlm {
namespace {

MoeConfig small(int64_t ep_size = 1, int64_t ep_rank = 0) {
  MoeConfig c;
  c.hidden_size = 16;
  c.n_experts = 8;
  c.top_k = 2;
  c.moe_intermediate_size = 8;
  c.dtype = DType::f64;
  c.seed = 3;
  c.ep_size = ep_size;
  c.ep_rank = ep_rank;
  return c;
}

TEST(MoeExpertParallel, ARankHoldsItsExpertsWithTheWholeLayersValues) {
  const PrecisionPolicy pol;
  MoeLayer whole(small(), pol, "mlp");
  for (int64_t r = 0; r < 4; ++r) {
    MoeLayer part(small(4, r), pol, "mlp");
    EXPECT_EQ(part.experts_gate_up().value.size(0), 2);
    EXPECT_TRUE(testing::bit_equal(part.experts_gate_up().value,
                                   whole.experts_gate_up().value.slice(0, 2 * r, 2 * r + 2)));
    EXPECT_TRUE(testing::bit_equal(part.experts_down().value,
                                   whole.experts_down().value.slice(0, 2 * r, 2 * r + 2)));
    EXPECT_TRUE(testing::bit_equal(part.router().weight().value, whole.router().weight().value));
  }
}

TEST(MoeExpertParallel, BadSettingsAreClearErrors) {
  const PrecisionPolicy pol;
  testing::expect_error([&] { MoeLayer(small(3), pol, "mlp"); },
                        "ep_size must be >= 1 and divide n_experts = 8, got 3");
  testing::expect_error([&] { MoeLayer(small(2, 2), pol, "mlp"); },
                        "ep_rank must be in [0, ep_size = 2), got 2");
  const Tensor x = Tensor::zeros({4, 16}, DType::f64);
  MoeLayer part(small(2, 1), pol, "mlp");
  const Context ctx{false, false};
  testing::expect_error([&] { part.forward(ctx, x, SeqLayout::single(4), nullptr); },
                        "an expert-parallel layer needs its group");
  std::unique_ptr<dist::Comm> one = dist::self_comm();
  testing::expect_error(
      [&] { part.forward(ctx, x, SeqLayout::single(4), nullptr, Tensor(), one.get()); },
      "the expert-parallel group is rank 0 of 1, the config says 1 of 2");
  MoeLayer whole(small(), pol, "mlp");
  testing::expect_error(
      [&] { whole.forward(ctx, x, SeqLayout::single(4), nullptr, Tensor(), one.get()); },
      "given to a layer that holds every expert");
}

// f64 on 2 and 4 ranks, f32 on 4.
TEST(MoeExpertParallel, MatchesTheWholeLayerOnTwoAndFourRanks) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const auto& [dt, n] : {std::pair{"f64", 2}, {"f64", 4}, {"f32", 4}}) {
    SCOPED_TRACE(std::string(dt) + " x " + std::to_string(n));
    testing::expect_dist_check(n, std::string("--moe-ep ") + dt + " cpu");
  }
}

}  // namespace
}  // namespace hlm
