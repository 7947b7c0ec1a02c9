// KdaLayer's context parallelism, chunkwise and headwise, on GPUs: `mpirun -np 4 hlm_dist_check
// --kda-cp f32 cuda short` runs the CUDA layer over 4 ranks (each on GPU local_rank % count, so
// ranks may share one; the emulation: one emulated GPU per process) and checks every slice
// against the whole batch on the same GPU (tests/dist/dist_check.cpp): one sequence over the 4
// ranks (the middle ranks' transition matrices through the CUDA core) and a one-token slice.
// The states and activations cross ranks through the host (MPI).
#include <gtest/gtest.h>

#include <string>

#include "core/device.h"
#include "dist/comm.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(KdaContextParallelGpu, MatchesTheWholeBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  const int n = 4;  // ranks may share a GPU: the check is of the numbers, not the speed
  testing::expect_dist_check(n, "--kda-cp f32 cuda short");
}

// The whole model's context parallelism on GPUs (`--model-cp f32 cuda short`, 2 ranks): KDA
// layers chunkwise and headwise, a DSA layer with the KPool indexer and its loss (latent rows and
// keys gathered over the ranks), MoE with the sequence aux loss, mHC; the loss terms and the
// gradients summed over the ranks against the whole batch on the same GPU.
TEST(ModelContextParallelGpu, MatchesTheWholeBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  testing::expect_dist_check(2, "--model-cp f32 cuda short");
}

}  // namespace
}  // namespace hlm
