// The NCCL backend (dist/nccl_comm.h).
#include "dist/nccl_comm.h"

#include "core/error.h"

#ifdef HLM_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <vector>

namespace hlm::dist {
namespace {

void check(ncclResult_t r, const char* call) {
  HLM_CHECK(r == ncclSuccess, "NCCL: {} failed: {}", call, ncclGetErrorString(r));
}

class NcclComm final : public Comm {
 public:
  // `owned` (may be null) is host's owner when this communicator came from split().
  NcclComm(Comm& host, std::unique_ptr<Comm> owned) : host_(host), owned_(std::move(owned)) {
    ncclUniqueId id{};
    if (host_.rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    host_.broadcast_bytes(&id, sizeof(id), 0);
    check(ncclCommInitRank(&c_, host_.size(), id, host_.rank()), "ncclCommInitRank");
  }
  ~NcclComm() override {
    if (c_ != nullptr) (void)ncclCommDestroy(c_);
  }
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* backend() const override { return "nccl"; }
  Device memory() const override { return Device::cuda; }

  void barrier() override {
    sync("barrier");
    host_.barrier();
  }
  void broadcast_bytes(void* data, size_t bytes, int root) override {
    HLM_CHECK(root >= 0 && root < size(), "Comm(nccl): root {} is not a rank of {}", root, size());
    check(ncclBroadcast(data, data, bytes, ncclUint8, root, c_, nullptr), "ncclBroadcast");
  }
  void allgather_bytes(const void* send, size_t bytes, void* recv) override {
    check(ncclAllGather(send, recv, bytes, ncclUint8, c_, nullptr), "ncclAllGather");
  }
  void alltoall_bytes(const void* send, size_t bytes, void* recv) override {
    const auto* s = static_cast<const uint8_t*>(send);
    auto* d = static_cast<uint8_t*>(recv);
    check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size(); ++r) {
      check(ncclSend(s + size_t(r) * bytes, bytes, ncclUint8, r, c_, nullptr), "ncclSend");
      check(ncclRecv(d + size_t(r) * bytes, bytes, ncclUint8, r, c_, nullptr), "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }
  void alltoallv_bytes(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes) override {
    const auto* s = static_cast<const uint8_t*>(send);
    auto* d = static_cast<uint8_t*>(recv);
    size_t so = 0, ro = 0;
    check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size(); ++r) {
      if (send_bytes[size_t(r)])
        check(ncclSend(s + so, send_bytes[size_t(r)], ncclUint8, r, c_, nullptr), "ncclSend");
      if (recv_bytes[size_t(r)])
        check(ncclRecv(d + ro, recv_bytes[size_t(r)], ncclUint8, r, c_, nullptr), "ncclRecv");
      so += send_bytes[size_t(r)];
      ro += recv_bytes[size_t(r)];
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }
  void send_bytes(const void* data, size_t bytes, int dst, int) override {
    check(ncclSend(data, bytes, ncclUint8, dst, c_, nullptr), "ncclSend");
  }
  void recv_bytes(void* data, size_t bytes, int src, int) override {
    check(ncclRecv(data, bytes, ncclUint8, src, c_, nullptr), "ncclRecv");
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    std::unique_ptr<Comm> h = host_.split(color, key);
    Comm& ref = *h;
    return std::make_unique<NcclComm>(ref, std::move(h));
  }
  void abort_job(int status) override { host_.abort_job(status); }

 protected:
  void allgather_host(const void* send, size_t bytes, void* recv) override {
    host_.allgather_bytes(send, bytes, recv);
  }

 private:
  static void sync(const char* what) {
    const cudaError_t e = cudaDeviceSynchronize();
    HLM_CHECK(e == cudaSuccess, "Comm(nccl)::{}: {}", what, cudaGetErrorString(e));
  }
  Comm& host_;
  std::unique_ptr<Comm> owned_;
  ncclComm_t c_ = nullptr;
};

}  // namespace

bool have_nccl() {
  return true;
}

std::unique_ptr<Comm> nccl_comm(Comm& host) {
  return std::make_unique<NcclComm>(host, nullptr);
}

}  // namespace hlm::dist

#else

namespace hlm::dist {

bool have_nccl() {
  return false;
}

std::unique_ptr<Comm> nccl_comm(Comm&) {
  HLM_FAIL("this build of hybridlm has no NCCL backend (a CUDA build finds nccl.h and libnccl)");
}

}  // namespace hlm::dist

#endif
