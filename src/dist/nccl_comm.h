// The NCCL backend of dist/comm.h: a communicator whose transport moves GPU memory, for the
// tensors of a job on GPUs (docs/parallel.md, "Communicators"). Built from a host communicator of
// the same processes (MPI's world under mpirun), which bootstraps it (rank 0's ncclUniqueId is
// broadcast over it) and carries the shapes the collectives compare.
//
// The transport: broadcast_bytes = ncclBroadcast, allgather_bytes = ncclAllGather, alltoall_bytes
// = one ncclSend and one ncclRecv per rank in a group, send_bytes / recv_bytes = ncclSend /
// ncclRecv (matched in order: the tag is not used). The tensor collectives of Comm run on it with
// the rank-ordered sums done by ops::sum_rows on the device, so their bits equal the host
// backends' on the same values (NCCL's own reductions, whose order is NCCL's, are not used). Every
// call is on the default stream; a collective's results are ready for the kernels after it.
//
// In the CUDA emulation an NCCL stand-in (tools/cuda_emu/nccl.cpp) carries the same calls over
// MPI, so this backend runs in CI without GPUs.
#pragma once

#include <memory>

#include "dist/comm.h"

namespace hlm::dist {

// Whether this build has the NCCL backend (a CUDA build with nccl.h and libnccl, or the
// emulation's stand-in with MPI).
bool have_nccl();

// The NCCL communicator over the processes of `host` (every rank calls; each on its own GPU, the
// current device). hlm::Error when the build has no NCCL or NCCL refuses (e.g. two ranks on one
// GPU). The host communicator must outlive it.
std::unique_ptr<Comm> nccl_comm(Comm& host);

}  // namespace hlm::dist
