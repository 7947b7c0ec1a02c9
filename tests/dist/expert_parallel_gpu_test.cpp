// MoeLayer's expert parallelism on GPUs: `mpirun -np 2 hlm_dist_check --moe-ep f32 cuda` runs the
// CUDA layer (its routed experts as grouped GEMMs) over 2 ranks, each on GPU local_rank % count
// (ranks may share one; the emulation: one emulated GPU per process), and checks each rank
// against one layer of every expert on the same GPU (tests/dist/dist_check.cpp). The rows cross
// ranks through the host (MPI).
#include <gtest/gtest.h>

#include <string>

#include "core/device.h"
#include "dist/comm.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(MoeExpertParallelGpu, MatchesTheWholeLayer) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  const int n = 2;
  testing::expect_dist_check(n, "--moe-ep f32 cuda");
}

}  // namespace
}  // namespace hlm
