// The MPI backend (dist/mpi_comm.h): Debian's OpenMPI under `mpirun`. MPI counts are ints, so a
// message over 1 GiB goes in pieces of 1 GiB (all-gather and all-to-all through a staging buffer
// per piece). MPI's errors are returned, not fatal, and become hlm::Error naming the call.
#include "dist/mpi_comm.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

#ifdef HLM_HAVE_MPI
#include <mpi.h>
#endif

namespace hlm::dist {

#ifdef HLM_HAVE_MPI
namespace {

constexpr size_t kPiece = size_t(1) << 30;
constexpr int kAlltoallvTag = 0x7A11;  // the pieces of a large alltoallv (MPI orders them per pair)

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, s, &n);
  HLM_FAIL("MPI {} failed: {}", what, std::string(s, size_t(n)));
}

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm c, bool owned) : c_(c), owned_(owned) {
    check(MPI_Comm_rank(c_, &rank_), "Comm_rank");
    check(MPI_Comm_size(c_, &size_), "Comm_size");
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&c_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  void barrier() override { check(MPI_Barrier(c_), "Barrier"); }

  void broadcast_bytes(void* data, size_t bytes, int root) override {
    auto* p = static_cast<uint8_t*>(data);
    for (size_t off = 0; off < bytes; off += kPiece)
      check(MPI_Bcast(p + off, int(std::min(kPiece, bytes - off)), MPI_BYTE, root, c_), "Bcast");
  }

  void allgather_bytes(const void* send, size_t bytes, void* recv) override {
    const auto* s = static_cast<const uint8_t*>(send);
    auto* r = static_cast<uint8_t*>(recv);
    if (bytes <= kPiece) {
      check(MPI_Allgather(s, int(bytes), MPI_BYTE, r, int(bytes), MPI_BYTE, c_), "Allgather");
      return;
    }
    std::vector<uint8_t> stage(size_t(size_) * kPiece);
    for (size_t off = 0; off < bytes; off += kPiece) {
      const size_t n = std::min(kPiece, bytes - off);
      check(MPI_Allgather(s + off, int(n), MPI_BYTE, stage.data(), int(n), MPI_BYTE, c_),
            "Allgather");
      for (int q = 0; q < size_; ++q)
        std::memcpy(r + size_t(q) * bytes + off, stage.data() + size_t(q) * n, n);
    }
  }

  void alltoall_bytes(const void* send, size_t bytes, void* recv) override {
    const auto* s = static_cast<const uint8_t*>(send);
    auto* r = static_cast<uint8_t*>(recv);
    if (bytes <= kPiece) {
      check(MPI_Alltoall(s, int(bytes), MPI_BYTE, r, int(bytes), MPI_BYTE, c_), "Alltoall");
      return;
    }
    std::vector<uint8_t> out(size_t(size_) * kPiece), in(size_t(size_) * kPiece);
    for (size_t off = 0; off < bytes; off += kPiece) {
      const size_t n = std::min(kPiece, bytes - off);
      for (int q = 0; q < size_; ++q)
        std::memcpy(out.data() + size_t(q) * n, s + size_t(q) * bytes + off, n);
      check(MPI_Alltoall(out.data(), int(n), MPI_BYTE, in.data(), int(n), MPI_BYTE, c_),
            "Alltoall");
      for (int q = 0; q < size_; ++q)
        std::memcpy(r + size_t(q) * bytes + off, in.data() + size_t(q) * n, n);
    }
  }

  void alltoallv_bytes(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes) override {
    const auto* s = static_cast<const uint8_t*>(send);
    auto* r = static_cast<uint8_t*>(recv);
    const size_t n = static_cast<size_t>(size_);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    size_t so = 0, ro = 0;
    bool fits = true;
    for (int q = 0; q < size_; ++q) {
      fits = fits && send_bytes[size_t(q)] <= kPiece && recv_bytes[size_t(q)] <= kPiece &&
             so <= kPiece && ro <= kPiece;
      sc[size_t(q)] = int(send_bytes[size_t(q)]), sd[size_t(q)] = int(so);
      rc[size_t(q)] = int(recv_bytes[size_t(q)]), rd[size_t(q)] = int(ro);
      so += send_bytes[size_t(q)];
      ro += recv_bytes[size_t(q)];
    }
    if (fits) {
      check(MPI_Alltoallv(s, sc.data(), sd.data(), MPI_BYTE, r, rc.data(), rd.data(), MPI_BYTE, c_),
            "Alltoallv");
      return;
    }
    // Over MPI's int counts: every block in pieces, point to point, all posted before any wait.
    std::vector<MPI_Request> reqs;
    so = ro = 0;
    for (int q = 0; q < size_; ++q) {
      for (size_t off = 0; off < recv_bytes[size_t(q)]; off += kPiece) {
        reqs.emplace_back();
        check(MPI_Irecv(r + ro + off, int(std::min(kPiece, recv_bytes[size_t(q)] - off)), MPI_BYTE,
                        q, kAlltoallvTag, c_, &reqs.back()),
              "Irecv");
      }
      for (size_t off = 0; off < send_bytes[size_t(q)]; off += kPiece) {
        reqs.emplace_back();
        check(MPI_Isend(s + so + off, int(std::min(kPiece, send_bytes[size_t(q)] - off)), MPI_BYTE,
                        q, kAlltoallvTag, c_, &reqs.back()),
              "Isend");
      }
      so += send_bytes[size_t(q)];
      ro += recv_bytes[size_t(q)];
    }
    check(MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "Waitall");
  }

  void send_bytes(const void* data, size_t bytes, int dst, int tag) override {
    const auto* p = static_cast<const uint8_t*>(data);
    size_t off = 0;
    do {
      const size_t n = std::min(kPiece, bytes - off);
      check(MPI_Send(p + off, int(n), MPI_BYTE, dst, tag, c_), "Send");
      off += n;
    } while (off < bytes);
  }

  void recv_bytes(void* data, size_t bytes, int src, int tag) override {
    auto* p = static_cast<uint8_t*>(data);
    size_t off = 0;
    do {
      const size_t n = std::min(kPiece, bytes - off);
      MPI_Status st;
      check(MPI_Recv(p + off, int(n), MPI_BYTE, src, tag, c_, &st), "Recv");
      int got = 0;
      MPI_Get_count(&st, MPI_BYTE, &got);
      HLM_CHECK(size_t(got) == n,
                "Comm(mpi): rank {} expected {} bytes from rank {} (tag {}), got {}", rank_, n, src,
                tag, got);
      off += n;
    } while (off < bytes);
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm nc;
    check(MPI_Comm_split(c_, color, key, &nc), "Comm_split");
    check(MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN), "Comm_set_errhandler");
    return std::make_unique<MpiComm>(nc, true);
  }
  void abort_job(int status) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(c_, status);
  }

 private:
  MPI_Comm c_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

struct Finalizer {
  ~Finalizer() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

}  // namespace

std::unique_ptr<Comm> mpi_world() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "Init_thread");
    static Finalizer finalizer;
  }
  check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "Comm_set_errhandler");
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, false);
}

bool have_mpi() {
  return true;
}

#else

std::unique_ptr<Comm> mpi_world() {
  HLM_FAIL("this build of hybridlm has no MPI backend (install libopenmpi-dev and rebuild)");
}

bool have_mpi() {
  return false;
}

#endif

}  // namespace hlm::dist
