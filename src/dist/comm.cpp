// The deterministic tensor collectives and the self backend (dist/comm.h); the MPI transport is in
// dist/mpi_comm.cpp.
#include "dist/comm.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "core/error.h"
#include "dist/mpi_comm.h"

namespace hlm::dist {
namespace {

// out[i] = in[0 n + i] + in[1 n + i] + ... + in[(N-1) n + i], left to right (rank order).
template <class T>
void sum_blocks(const void* in_, int N, size_t n, void* out_) {
  const T* in = static_cast<const T*>(in_);
  T* out = static_cast<T*>(out_);
  for (size_t i = 0; i < n; ++i) {
    T s = in[i];
    for (int r = 1; r < N; ++r) s += in[size_t(r) * n + i];
    out[i] = s;
  }
}

void sum_blocks(DType dt, const void* in, int N, size_t n, void* out, const char* what) {
  switch (dt) {
    case DType::f32:
      return sum_blocks<float>(in, N, n, out);
    case DType::f64:
      return sum_blocks<double>(in, N, n, out);
    case DType::i32:
      return sum_blocks<int32_t>(in, N, n, out);
    case DType::i64:
      return sum_blocks<int64_t>(in, N, n, out);
    default:
      HLM_FAIL("{}: cannot sum {}", what, dtype_name(dt));
  }
}

void require_summable(const Tensor& t, const char* what) {
  const DType dt = t.dtype();
  HLM_CHECK(dt == DType::f32 || dt == DType::f64 || dt == DType::i32 || dt == DType::i64,
            "{}: sums f32, f64, i32 or i64 tensors, got {}", what, dtype_name(dt));
}

void require_host(const Tensor& t, const char* what) {
  HLM_CHECK(t.defined() && t.is_cpu() && t.is_contiguous(),
            "{}: needs a defined contiguous CPU tensor, got {}", what,
            t.defined() ? t.describe() : "undefined");
}

class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend() const override { return "self"; }
  void barrier() override {}
  void broadcast_bytes(void*, size_t, int root) override { check_root(root); }
  void allgather_bytes(const void* send, size_t bytes, void* recv) override {
    if (bytes) std::memmove(recv, send, bytes);
  }
  void alltoall_bytes(const void* send, size_t bytes, void* recv) override {
    if (bytes) std::memmove(recv, send, bytes);
  }
  void send_bytes(const void* data, size_t bytes, int dst, int tag) override {
    check_root(dst);
    const auto* p = static_cast<const uint8_t*>(data);
    pending_[tag].emplace_back(p, p + bytes);
  }
  void recv_bytes(void* data, size_t bytes, int src, int tag) override {
    check_root(src);
    auto it = pending_.find(tag);
    HLM_CHECK(it != pending_.end() && !it->second.empty(),
              "Comm(self): recv with tag {} has no matching send (it would wait forever)", tag);
    HLM_CHECK(it->second.front().size() == bytes,
              "Comm(self): recv of {} bytes with tag {} matches a send of {}", bytes, tag,
              it->second.front().size());
    if (bytes) std::memcpy(data, it->second.front().data(), bytes);
    it->second.erase(it->second.begin());
  }
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SelfComm>(); }
  void abort_job(int) override {}

 private:
  static void check_root(int r) {
    HLM_CHECK(r == 0, "Comm(self): rank {} does not exist (one process)", r);
  }
  std::map<int, std::vector<std::vector<uint8_t>>> pending_;
};

}  // namespace

void Comm::check_same(const Tensor& t, const char* what) {
  // dtype, rank, up to 8 dimensions: every rank sees every rank's and names the first mismatch.
  constexpr int kSlots = 10;
  int64_t mine[kSlots] = {int64_t(t.dtype()), t.dim()};
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), 8); ++d) mine[2 + d] = t.size(d);
  std::vector<int64_t> all(size_t(size()) * kSlots);
  allgather_bytes(mine, sizeof(mine), all.data());
  for (int r = 0; r < size(); ++r)
    HLM_CHECK(std::memcmp(&all[size_t(r) * kSlots], mine, sizeof(mine)) == 0,
              "{}: rank {} passed a different shape or dtype than rank {} ({})", what, r, rank(),
              t.describe());
}

Tensor Comm::reduce_scatter_sum(const Tensor& t) {
  constexpr const char* what = "Comm::reduce_scatter_sum";
  require_host(t, what);
  require_summable(t, what);
  const int N = size();
  HLM_CHECK(t.dim() >= 1 && t.size(0) % N == 0,
            "{}: the first dimension must be a multiple of the {} ranks, got {}", what, N,
            t.describe());
  check_same(t, what);
  Shape s = t.shape();
  s[0] /= N;
  Tensor out = Tensor::empty(s, t.dtype());
  const size_t block = t.nbytes() / size_t(N), n = size_t(t.numel()) / size_t(N);
  std::vector<uint8_t> recv(t.nbytes());
  alltoall_bytes(t.raw(), block, recv.data());
  sum_blocks(t.dtype(), recv.data(), N, n, out.raw(), what);
  return out;
}

void Comm::allreduce_sum(Tensor& t) {
  constexpr const char* what = "Comm::allreduce_sum";
  require_host(t, what);
  require_summable(t, what);
  check_same(t, what);
  const int N = size();
  if (N == 1 || t.numel() == 0) return;
  const size_t E = size_t(t.numel()), es = t.element_size(), c = (E + size_t(N) - 1) / size_t(N);
  // Padded to N chunks of c elements: chunk r is summed by rank r, then every chunk gathered.
  std::vector<uint8_t> padded(size_t(N) * c * es, 0), recv(size_t(N) * c * es), mine(c * es);
  std::memcpy(padded.data(), t.raw(), E * es);
  alltoall_bytes(padded.data(), c * es, recv.data());
  sum_blocks(t.dtype(), recv.data(), N, c, mine.data(), what);
  allgather_bytes(mine.data(), c * es, padded.data());
  std::memcpy(t.raw(), padded.data(), E * es);
}

Tensor Comm::allgather(const Tensor& t) {
  constexpr const char* what = "Comm::allgather";
  require_host(t, what);
  HLM_CHECK(t.dim() >= 1, "{}: needs a tensor of rank >= 1, got {}", what, t.describe());
  check_same(t, what);
  Shape s = t.shape();
  s[0] *= size();
  Tensor out = Tensor::empty(s, t.dtype());
  allgather_bytes(t.raw(), t.nbytes(), out.raw());
  return out;
}

void Comm::broadcast(Tensor& t, int root) {
  constexpr const char* what = "Comm::broadcast";
  require_host(t, what);
  HLM_CHECK(root >= 0 && root < size(), "{}: root {} is not a rank of {}", what, root, size());
  check_same(t, what);
  broadcast_bytes(t.raw(), t.nbytes(), root);
}

std::unique_ptr<Comm> self_comm() {
  return std::make_unique<SelfComm>();
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

namespace {
Comm* g_world = nullptr;  // set once world() has built it
}  // namespace

Comm& world() {
  static std::unique_ptr<Comm> w = [] {
    if (!launched_by_mpi()) return self_comm();
    HLM_CHECK(have_mpi(),
              "this process was started by an MPI launcher, but this build of hybridlm has no MPI "
              "(install libopenmpi-dev and rebuild)");
    return mpi_world();
  }();
  g_world = w.get();
  return *w;
}

void end_job_on_error(int status) {
  if (g_world != nullptr && g_world->size() > 1) g_world->abort_job(status);
}

}  // namespace hlm::dist
