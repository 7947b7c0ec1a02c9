// The subset of NCCL that hybridlm calls (dist/nccl_comm.cpp), for the CPU emulation build: the
// same C declarations as nccl.h, carried over MPI between the processes of an mpirun job, so the
// NCCL backend runs in CI without GPUs. In the emulation device memory is host memory, and
// kernels have finished when a call returns, so every call completes before it returns (NCCL's
// calls are asynchronous on a stream; the difference is not observable to a caller that orders
// its work on the default stream, as hybridlm does).
//
//   ncclGetUniqueId      an id naming the calling process's MPI world rank and a serial number
//   ncclCommInitRank     the members send (rank, world rank) to the id's process, which answers
//                        with the list; all create the group's MPI communicator (MPI_Comm_create
//                        _group: collective over the members only, as NCCL's init)
//   ncclSend / ncclRecv  MPI_Isend / MPI_Irecv of bytes, completed at the outermost ncclGroupEnd
//                        (at once outside a group); MPI keeps their order per peer, as NCCL does
//   ncclAllGather        MPI_Allgather; ncclBroadcast  MPI_Bcast
// Only byte-sized data types (ncclInt8, ncclUint8) are carried: what hybridlm sends.
#include <mpi.h>
#include <nccl.h>

#include <climits>
#include <cstring>
#include <vector>

struct ncclComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
};

namespace {

constexpr int kTagBase = 0x4E43;  // the tags of the init exchange (kTagBase + 2 serial (+ 1))
int g_depth = 0;                  // ncclGroupStart nesting
std::vector<MPI_Request> g_pending;

struct Id {
  char magic[8];
  int root_world;
  int serial;
};

bool mpi_ready() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  return inited && !finalized;
}

ncclResult_t bytes_of(size_t count, ncclDataType_t dt, int* n) {
  if (dt != ncclInt8 && dt != ncclUint8) return ncclInvalidArgument;
  if (count > size_t(INT_MAX)) return ncclInvalidArgument;
  *n = int(count);
  return ncclSuccess;
}

ncclResult_t finish(MPI_Request r) {
  if (g_depth > 0) {
    g_pending.push_back(r);
    return ncclSuccess;
  }
  return MPI_Wait(&r, MPI_STATUS_IGNORE) == MPI_SUCCESS ? ncclSuccess : ncclSystemError;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclSystemError:
      return "system error (MPI, in the NCCL stand-in)";
    case ncclInvalidArgument:
      return "invalid argument (the NCCL stand-in carries bytes only, below 2 GiB)";
    case ncclInvalidUsage:
      return "invalid usage (the NCCL stand-in needs MPI initialised)";
    default:
      return "error";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!mpi_ready()) return ncclInvalidUsage;
  static int serial = 0;
  Id v{};
  std::memcpy(v.magic, "hlmnccl", 8);
  MPI_Comm_rank(MPI_COMM_WORLD, &v.root_world);
  v.serial = serial++;
  std::memset(id, 0, sizeof(*id));
  std::memcpy(id->internal, &v, sizeof(v));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (!mpi_ready()) return ncclInvalidUsage;
  Id v;
  std::memcpy(&v, id.internal, sizeof(v));
  if (std::memcmp(v.magic, "hlmnccl", 8) != 0 || nranks < 1 || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  const int tag = kTagBase + 2 * (v.serial % 1000);
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  std::vector<int> world(size_t(nranks), -1);
  if (rank == 0) {
    if (me != v.root_world) return ncclInvalidArgument;
    world[0] = me;
    for (int i = 1; i < nranks; ++i) {
      int pair[2];
      MPI_Recv(pair, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (pair[0] <= 0 || pair[0] >= nranks || world[size_t(pair[0])] != -1)
        return ncclInvalidArgument;
      world[size_t(pair[0])] = pair[1];
    }
    for (int i = 1; i < nranks; ++i)
      MPI_Send(world.data(), nranks, MPI_INT, world[size_t(i)], tag + 1, MPI_COMM_WORLD);
  } else {
    int pair[2] = {rank, me};
    MPI_Send(pair, 2, MPI_INT, v.root_world, tag, MPI_COMM_WORLD);
    MPI_Recv(world.data(), nranks, MPI_INT, v.root_world, tag + 1, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
  }
  MPI_Group wg, g;
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  MPI_Group_incl(wg, nranks, world.data(), &g);
  auto* c = new ncclComm;
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, g, tag, &c->comm);
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  if (rc != MPI_SUCCESS) {
    delete c;
    return ncclSystemError;
  }
  MPI_Comm_rank(c->comm, &c->rank);
  MPI_Comm_size(c->comm, &c->size);
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  if (mpi_ready() && comm->comm != MPI_COMM_NULL) MPI_Comm_free(&comm->comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++g_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (g_depth == 0) return ncclInvalidUsage;
  if (--g_depth > 0) return ncclSuccess;
  std::vector<MPI_Request> r;
  r.swap(g_pending);
  if (r.empty()) return ncclSuccess;
  return MPI_Waitall(int(r.size()), r.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS ? ncclSuccess
                                                                                  : ncclSystemError;
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                      cudaStream_t) {
  int n = 0;
  if (const ncclResult_t e = bytes_of(count, dt, &n); e != ncclSuccess) return e;
  MPI_Request r;
  if (MPI_Isend(buf, n, MPI_BYTE, peer, 0, comm->comm, &r) != MPI_SUCCESS) return ncclSystemError;
  return finish(r);
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                      cudaStream_t) {
  int n = 0;
  if (const ncclResult_t e = bytes_of(count, dt, &n); e != ncclSuccess) return e;
  MPI_Request r;
  if (MPI_Irecv(buf, n, MPI_BYTE, peer, 0, comm->comm, &r) != MPI_SUCCESS) return ncclSystemError;
  return finish(r);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t dt,
                           ncclComm_t comm, cudaStream_t) {
  int n = 0;
  if (const ncclResult_t e = bytes_of(count, dt, &n); e != ncclSuccess) return e;
  const void* s =
      send == static_cast<char*>(recv) + size_t(comm->rank) * count ? MPI_IN_PLACE : send;
  return MPI_Allgather(s, n, MPI_BYTE, recv, n, MPI_BYTE, comm->comm) == MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t dt, int root,
                           ncclComm_t comm, cudaStream_t) {
  int n = 0;
  if (const ncclResult_t e = bytes_of(count, dt, &n); e != ncclSuccess) return e;
  if (comm->rank == root && send != recv && n > 0) std::memcpy(recv, send, size_t(n));
  return MPI_Bcast(recv, n, MPI_BYTE, root, comm->comm) == MPI_SUCCESS ? ncclSuccess
                                                                       : ncclSystemError;
}

}  // extern "C"
