// dist/comm.h: the self backend in this process, and the MPI backend across 2 and 4 processes
// (`mpirun --oversubscribe`, this machine's cores) through tests/dist/dist_check.cpp, whose ranks
// check every collective bit for bit against the rank-ordered sums they compute themselves.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "dist/comm.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(Dist, TheSelfBackendIsOneRank) {
  std::unique_ptr<dist::Comm> c = dist::self_comm();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  Tensor t = Tensor::from_vector<float>({3}, {1.5f, -2.f, 3.25f});
  const Tensor before = t.contiguous().to(DType::f32);
  c->allreduce_sum(t);
  EXPECT_TRUE(testing::bit_equal(t, before));
  EXPECT_TRUE(testing::bit_equal(c->reduce_scatter_sum(t), before));
  EXPECT_TRUE(testing::bit_equal(c->allgather(t), before));
  int64_t out = 42, in = 0;
  c->send_bytes(&out, sizeof(out), 0, 7);
  c->recv_bytes(&in, sizeof(in), 0, 7);
  EXPECT_EQ(in, 42);
  testing::expect_error([&] { c->recv_bytes(&in, sizeof(in), 0, 7); }, "no matching send");
  testing::expect_error([&] { c->broadcast(t, 1); }, "root 1 is not a rank of 1");
  Tensor h = Tensor::zeros({2}, DType::bf16);
  testing::expect_error([&] { c->allreduce_sum(h); }, "sums f32, f64, i32 or i64");
}

TEST(Dist, CollectivesAcrossProcesses) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (int n : {2, 4}) {
    SCOPED_TRACE(n);
    // (The self backend's test above runs in-process with the leak check on.)
    const std::string out = testing::expect_dist_check(n, "");
    EXPECT_NE(out.find("of " + std::to_string(n) + " (mpi)"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace hlm
