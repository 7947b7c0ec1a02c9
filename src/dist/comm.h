// Communicators: the processes of a job and the groups built from them (docs/parallel.md).
//
// A Comm is a group of `size()` processes, this one being `rank()`. Each backend moves bytes
// (barrier, broadcast, all-gather, all-to-all(v), send / recv, split into sub-groups); the tensor
// collectives on top are written once, here, and are deterministic: every sum over ranks is taken
// in rank order 0, 1, ..., N-1 for every element, whatever order the messages arrive in, so all
// ranks get the same bits and a run repeats bit for bit for a given N.
//
//   allreduce_sum   = reduce_scatter_sum (all-to-all of 1/N chunks, each summed in rank order by
//                     the rank that owns it) + all-gather of the summed chunks: the volume of a
//                     ring all-reduce, 2 (N-1)/N of the tensor per rank.
//
// Backends: self (one process; every collective is the identity) and MPI (Debian's OpenMPI;
// `mpirun -np N hybridlm ...`). world() is MPI's world when the process was started by an MPI
// launcher (and the build has MPI), else self.
// Tensors are contiguous and on memory(): the host for self and MPI, the GPU for NCCL
// (dist/nccl_comm.h). The sums support f32, f64, i32 and i64, each in the tensor's own dtype
// (integers on the GPU are summed on the host: exact, for counts), and start from zero
// (ops::sum_rows' order: the same bits on either side). A
// collective whose arguments differ between ranks (shapes, dtypes, roots) is an error
// on the rank that detects it; a rank that dies ends the job (the MPI launcher stops the others).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace hlm::dist {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  // Where the transport's buffers live: the host (self, MPI) or the GPU (NCCL). The tensor
  // collectives below take contiguous tensors there.
  virtual Device memory() const { return Device::cpu; }

  // ---- the transport every backend provides (bytes; every rank calls, with the same sizes) ----
  virtual void barrier() = 0;
  virtual void broadcast_bytes(void* data, size_t bytes, int root) = 0;
  // recv holds size() blocks of `bytes`: block r is rank r's send.
  virtual void allgather_bytes(const void* send, size_t bytes, void* recv) = 0;
  // send holds size() blocks of `bytes`, block r for rank r; recv gets block r from rank r.
  virtual void alltoall_bytes(const void* send, size_t bytes, void* recv) = 0;
  // Blocks of different sizes: send holds send_bytes[r] bytes for rank r, the blocks in rank
  // order; recv gets recv_bytes[r] bytes from rank r, in rank order. Each rank's recv_bytes[r]
  // must equal rank r's send_bytes to it (the caller exchanges the sizes first).
  virtual void alltoallv_bytes(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                               const std::vector<size_t>& recv_bytes) = 0;
  virtual void send_bytes(const void* data, size_t bytes, int dst, int tag) = 0;
  virtual void recv_bytes(void* data, size_t bytes, int src, int tag) = 0;
  // The ranks that pass the same color, ordered by (key, rank), as a new communicator.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
  // Ends every process of the job with `status` (MPI_Abort), so that ranks waiting in a
  // collective for this one do not hang; a single process returns (the caller exits).
  virtual void abort_job(int status) = 0;

  // ---- tensors (contiguous, on memory()), deterministic ----
  // t = the sum of every rank's t, in rank order; the same bits on every rank.
  void allreduce_sum(Tensor& t);
  // t [N m, ...] (first dimension a multiple of N): rows [r m, (r+1) m) summed over the ranks in
  // rank order, as a new [m, ...] tensor.
  Tensor reduce_scatter_sum(const Tensor& t);
  // t [m, ...] from every rank: [N m, ...], rank r's rows at [r m, (r+1) m).
  Tensor allgather(const Tensor& t);
  // t = root's t (same shape and dtype on every rank).
  void broadcast(Tensor& t, int root);
  // t [R, ...]: its rows in runs of send_rows[q] (rank order, summing to R) go to rank q; the
  // result [sum recv_rows, ...] stacks the run each rank q sent here (recv_rows[q] rows), in rank
  // order. The row shape and dtype must agree on every rank, and recv_rows[q] must be rank q's
  // send_rows to this rank (exchange the counts first, e.g. with an all-to-all).
  Tensor alltoallv(const Tensor& t, const std::vector<int64_t>& send_rows,
                   const std::vector<int64_t>& recv_rows);
  // t [N, ...]: block q goes to rank q; the result's block q came from rank q (same shape).
  Tensor alltoall(const Tensor& t);

 protected:
  // Checks (on every rank) that all ranks passed the same shape and dtype; `what` names the call.
  void check_same(const Tensor& t, const char* what);
  // recv = every rank's `bytes` of host memory (the shapes check_same compares); a backend whose
  // transport moves device memory sends them another way.
  virtual void allgather_host(const void* send, size_t bytes, void* recv) {
    allgather_bytes(send, bytes, recv);
  }
};

// The tensor collectives for a tensor on any device, in any layout: one that is not contiguous
// on c.memory() is copied there and the result comes back to its device (a GPU tensor over a host
// communicator, as the layers' parallel paths take them where no NCCL group is given).
Tensor allgather_from(Comm& c, const Tensor& t);
Tensor alltoall_from(Comm& c, const Tensor& t);
// The sum over the ranks (allreduce_sum) of t, as a new tensor on t's device (t is not changed).
Tensor allreduce_from(Comm& c, const Tensor& t);
Tensor alltoallv_from(Comm& c, const Tensor& t, const std::vector<int64_t>& send_rows,
                      const std::vector<int64_t>& recv_rows);

// Rows split over the ranks: rank r holds rows [bounds[r], bounds[r + 1]) of a [T, ...] tensor
// (bounds [size() + 1] ascending from 0 to T, the same on every rank; parts may be empty and of
// different lengths). allgather_rows: the whole [T, ...] on every rank from each rank's part (one
// all-gather of blocks padded to the longest part), on part's device, in part's dtype (any).
// reduce_scatter_rows: every rank passes a whole [T, ...] (f32, f64, i32 or i64); each gets its
// own rows summed over the ranks in rank order (one reduce-scatter of padded blocks), on whole's
// device.
Tensor allgather_rows(Comm& group, const Tensor& part, const std::vector<int64_t>& bounds);
Tensor reduce_scatter_rows(Comm& group, const Tensor& whole, const std::vector<int64_t>& bounds);

// One process: rank 0 of 1.
std::unique_ptr<Comm> self_comm();

// Whether this build has the MPI backend, and whether the process was started by an MPI launcher
// (mpirun / mpiexec: the launcher's environment is set).
bool have_mpi();
bool launched_by_mpi();
// This process's rank among the job's processes on its host (the launcher's local rank:
// OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID), 0 when not launched.
int local_rank();

// The job's communicator: MPI's world under an MPI launcher (MPI is initialised on the first call
// and finalised at exit), else self. Under a launcher in a build without MPI: hlm::Error.
Comm& world();
// After an error that ends this process: in a job of several processes whose world() was started,
// ends them all with `status` (Comm::abort_job); otherwise returns.
void end_job_on_error(int status);

}  // namespace hlm::dist
