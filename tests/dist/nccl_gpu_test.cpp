// The NCCL backend (dist/nccl_comm.h) across processes: `mpirun -np N hlm_dist_check --nccl` runs
// every collective over GPU tensors and checks each result equals the host (MPI) backend's bit
// for bit (tests/dist/dist_check.cpp). In the emulation build the NCCL stand-in carries the calls
// over MPI (N = 2 and 4); on GPUs each rank needs its own device, so N is at most the device
// count.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/device.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(NcclGpu, CollectivesEqualTheHostBackends) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi() || !dist::have_nccl()) GTEST_SKIP() << "this build has no MPI or NCCL";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  int tried = 0;
  for (int n : {2, 4}) {
    if (!cuda_emulated() && n > cuda_device_count()) continue;  // one GPU per rank
    SCOPED_TRACE(n);
    ++tried;
    const std::string out = testing::expect_dist_check(n, "--nccl");
    EXPECT_NE(out.find("(mpi and nccl)"), std::string::npos) << out;
  }
  if (tried == 0) GTEST_SKIP() << "one GPU: NCCL needs a GPU per rank";
}

}  // namespace
}  // namespace hlm
