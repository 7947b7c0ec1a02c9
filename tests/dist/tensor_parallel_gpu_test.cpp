// Tensor parallelism on GPUs: `mpirun -np 2 hlm_dist_check --tp f32 cuda` runs each rank's part
// of a KDA layer, the MLP and DSA layers (KPool, the indexer loss) on CUDA (each rank on GPU
// local_rank % count, so ranks may share one; the emulation: one emulated GPU per process) and
// checks the parts summed over the ranks against the whole layer on the same GPU
// (tests/dist/dist_check.cpp). The sums cross ranks through the host (MPI).
#include <gtest/gtest.h>

#include "core/device.h"
#include "dist/comm.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(TensorParallelGpu, MatchesTheWholeLayer) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  testing::expect_dist_check(2, "--tp f32 cuda");
}

// The whole model's tensor parallelism on GPUs (`--model-tp f32 cuda`, 2 ranks): KDA and DSA
// layers, a dense MLP, MoE with the aux loss, mHC and MTP; the loss terms and every gradient
// against the one-process model on the same GPU. The group's sums run over NCCL (in the
// emulation build its stand-in).
TEST(ModelTensorParallelGpu, MatchesTheWholeModel) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  testing::expect_dist_check(2, "--model-tp f32 cuda");
}

// Tensor and context parallelism together on GPUs (`--model-tpcp f32 cuda`, tp 2 x cp 2 over 4
// ranks, the sums through the host): the model's loss terms and gradients against the whole model
// on the whole batch on the same GPU.
TEST(TensorParallelGpu, WithContextParallelMatchesTheWholeModel) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  testing::expect_dist_check(4, "--model-tpcp f32 cuda");
}

}  // namespace
}  // namespace hlm
