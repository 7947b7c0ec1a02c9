// The deterministic tensor collectives and the self backend (dist/comm.h); the MPI transport is in
// dist/mpi_comm.cpp.
#include "dist/comm.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "dist/mpi_comm.h"
#include "ops/tensor_ops.h"

namespace hlm::dist {
namespace {

// out[i] = 0 + in[0 n + i] + in[1 n + i] + ... + in[(N-1) n + i], left to right (rank order).
template <class T>
Tensor sum_int_blocks(const Tensor& recv, int N, int64_t n) {
  Tensor out = Tensor::empty({n}, recv.dtype());
  const T* in = recv.data<T>();
  T* o = out.data<T>();
  for (int64_t i = 0; i < n; ++i) {
    T s = T(0);
    for (int r = 0; r < N; ++r) s += in[r * n + i];
    o[i] = s;
  }
  return out;
}

// recv [N n] (N blocks of n elements, on `mem`) -> their sum [n]. Floats through ops::sum_rows
// (rows in ascending order from zero, on either device: the same bits on the host and the GPU);
// integers (host only) by the same loop.
Tensor sum_blocks(const Tensor& recv, int N, int64_t n) {
  // Integers on a device: summed on the host (exact; such sums are counts, a few numbers).
  if (recv.device() != Device::cpu && (recv.dtype() == DType::i32 || recv.dtype() == DType::i64))
    return sum_blocks(recv.to(Device::cpu), N, n).to(recv.device());
  switch (recv.dtype()) {
    case DType::i32:
      return sum_int_blocks<int32_t>(recv, N, n);
    case DType::i64:
      return sum_int_blocks<int64_t>(recv, N, n);
    default:
      return ops::sum_rows(recv.view({N, n}), recv.dtype());
  }
}

void require_summable(const Tensor& t, Device mem, const char* what) {
  const DType dt = t.dtype();
  (void)mem;
  HLM_CHECK(dt == DType::f32 || dt == DType::f64 || dt == DType::i32 || dt == DType::i64,
            "{}: sums f32, f64, i32 or i64 tensors, got {}", what, dtype_name(dt));
}

void require_on(const Tensor& t, Device mem, const char* what) {
  HLM_CHECK(t.defined() && t.device() == mem && t.is_contiguous(),
            "{}: needs a defined contiguous {} tensor, got {}", what,
            mem == Device::cpu ? "CPU" : device_name(mem),
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
  void alltoallv_bytes(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes) override {
    HLM_CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0],
              "Comm::alltoallv_bytes: one rank sends {} bytes to itself but receives {}",
              send_bytes.empty() ? 0 : send_bytes[0], recv_bytes.empty() ? 0 : recv_bytes[0]);
    if (send_bytes[0]) std::memmove(recv, send, send_bytes[0]);
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
  allgather_host(mine, sizeof(mine), all.data());
  for (int r = 0; r < size(); ++r)
    HLM_CHECK(std::memcmp(&all[size_t(r) * kSlots], mine, sizeof(mine)) == 0,
              "{}: rank {} passed a different shape or dtype than rank {} ({})", what, r, rank(),
              t.describe());
}

Tensor Comm::reduce_scatter_sum(const Tensor& t) {
  constexpr const char* what = "Comm::reduce_scatter_sum";
  const Device mem = memory();
  require_on(t, mem, what);
  require_summable(t, mem, what);
  const int N = size();
  HLM_CHECK(t.dim() >= 1 && t.size(0) % N == 0,
            "{}: the first dimension must be a multiple of the {} ranks, got {}", what, N,
            t.describe());
  check_same(t, what);
  Shape s = t.shape();
  s[0] /= N;
  const int64_t n = t.numel() / N;
  Tensor recv = Tensor::empty({t.numel()}, t.dtype(), mem);
  if (n > 0) alltoall_bytes(t.raw(), t.nbytes() / size_t(N), recv.raw());
  return sum_blocks(recv, N, n).view(s);
}

Tensor Comm::alltoallv(const Tensor& t, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows) {
  constexpr const char* what = "Comm::alltoallv";
  const Device mem = memory();
  require_on(t, mem, what);
  const int N = size();
  HLM_CHECK(t.dim() >= 1 && int(send_rows.size()) == N && int(recv_rows.size()) == N,
            "{}: takes rows [R, ...] and {} send and receive counts, got {}, {} and {}", what, N,
            t.describe(), send_rows.size(), recv_rows.size());
  // The row shape and dtype agree on every rank: compare them as an empty [0, ...] tensor.
  Shape row = t.shape();
  row[0] = 0;
  check_same(Tensor::empty(row, t.dtype()), what);
  int64_t sent = 0, got = 0;
  for (int q = 0; q < N; ++q) {
    HLM_CHECK(send_rows[size_t(q)] >= 0 && recv_rows[size_t(q)] >= 0,
              "{}: negative row count for rank {}", what, q);
    sent += send_rows[size_t(q)];
    got += recv_rows[size_t(q)];
  }
  HLM_CHECK(sent == t.size(0), "{}: the send counts add up to {} rows, t has {}", what, sent,
            t.size(0));
  const size_t es = t.element_size();
  int64_t per_row = 1;
  for (int64_t d = 1; d < t.dim(); ++d) per_row *= t.size(d);
  std::vector<size_t> sb(static_cast<size_t>(N)), rb(static_cast<size_t>(N));
  for (int q = 0; q < N; ++q) {
    sb[size_t(q)] = size_t(send_rows[size_t(q)] * per_row) * es;
    rb[size_t(q)] = size_t(recv_rows[size_t(q)] * per_row) * es;
  }
  Shape out = t.shape();
  out[0] = got;
  Tensor recv = Tensor::empty(out, t.dtype(), mem);
  alltoallv_bytes(t.raw(), sb, recv.raw(), rb);
  return recv;
}

void Comm::allreduce_sum(Tensor& t) {
  constexpr const char* what = "Comm::allreduce_sum";
  const Device mem = memory();
  require_on(t, mem, what);
  require_summable(t, mem, what);
  check_same(t, what);
  const int N = size();
  if (N == 1 || t.numel() == 0) return;
  const int64_t E = t.numel(), c = (E + N - 1) / N;
  const size_t es = t.element_size();
  // Padded to N chunks of c elements: chunk r is summed by rank r, then every chunk gathered.
  Tensor padded = Tensor::zeros({int64_t(N) * c}, t.dtype(), mem);
  device_copy(padded.raw(), mem, t.raw(), mem, size_t(E) * es);
  Tensor recv = Tensor::empty({int64_t(N) * c}, t.dtype(), mem);
  alltoall_bytes(padded.raw(), size_t(c) * es, recv.raw());
  const Tensor mine = sum_blocks(recv, N, c);
  allgather_bytes(mine.raw(), size_t(c) * es, padded.raw());
  device_copy(t.raw(), mem, padded.raw(), mem, size_t(E) * es);
}

Tensor Comm::allgather(const Tensor& t) {
  constexpr const char* what = "Comm::allgather";
  require_on(t, memory(), what);
  HLM_CHECK(t.dim() >= 1, "{}: needs a tensor of rank >= 1, got {}", what, t.describe());
  check_same(t, what);
  Shape s = t.shape();
  s[0] *= size();
  Tensor out = Tensor::empty(s, t.dtype(), memory());
  if (t.nbytes() > 0) allgather_bytes(t.raw(), t.nbytes(), out.raw());
  return out;
}

Tensor Comm::alltoall(const Tensor& t) {
  constexpr const char* what = "Comm::alltoall";
  require_on(t, memory(), what);
  HLM_CHECK(t.dim() >= 1 && t.size(0) == size(), "{}: takes one block per rank ([{}, ...]), got {}",
            what, size(), t.describe());
  check_same(t, what);
  Tensor out = Tensor::empty(t.shape(), t.dtype(), memory());
  if (t.nbytes() > 0) alltoall_bytes(t.raw(), t.nbytes() / size_t(size()), out.raw());
  return out;
}

namespace {

// t as a contiguous tensor on `mem` (itself when it is one), and a result back to `dev`.
Tensor staged(const Tensor& t, Device mem) {
  const Tensor c = ops::contiguous(t);
  return c.device() == mem ? c : c.to(mem);
}
Tensor unstaged(const Tensor& r, Device dev) {
  return r.device() == dev ? r : r.to(dev);
}

}  // namespace

Tensor allgather_from(Comm& c, const Tensor& t) {
  return unstaged(c.allgather(staged(t, c.memory())), t.device());
}

Tensor allreduce_from(Comm& c, const Tensor& t) {
  Tensor s = staged(t, c.memory());
  if (s.raw() == t.raw()) s = s.clone();  // staged may hand back t itself
  c.allreduce_sum(s);
  return unstaged(s, t.device());
}

Tensor alltoall_from(Comm& c, const Tensor& t) {
  return unstaged(c.alltoall(staged(t, c.memory())), t.device());
}

Tensor alltoallv_from(Comm& c, const Tensor& t, const std::vector<int64_t>& send_rows,
                      const std::vector<int64_t>& recv_rows) {
  return unstaged(c.alltoallv(staged(t, c.memory()), send_rows, recv_rows), t.device());
}

Tensor allgather_rows(Comm& group, const Tensor& part, const std::vector<int64_t>& bounds) {
  const int n = group.size(), r = group.rank();
  HLM_CHECK(int(bounds.size()) == n + 1 && bounds.front() == 0,
            "allgather_rows: row bounds must hold {} offsets from 0, got {}", n + 1, bounds.size());
  int64_t m = 0;
  for (int q = 0; q < n; ++q) {
    HLM_CHECK(bounds[size_t(q)] <= bounds[size_t(q) + 1], "allgather_rows: row bounds must ascend");
    m = std::max(m, bounds[size_t(q) + 1] - bounds[size_t(q)]);
  }
  const int64_t rows = bounds[size_t(r) + 1] - bounds[size_t(r)];
  HLM_CHECK(part.dim() >= 1 && part.size(0) == rows,
            "allgather_rows: rank {} holds rows [{}, {}), its part is {}", r, bounds[size_t(r)],
            bounds[size_t(r) + 1], part.describe());
  Shape padded = part.shape();
  padded[0] = m;
  Tensor block = Tensor::zeros(padded, part.dtype(), part.device());
  if (rows > 0) {
    Tensor head = block.slice(0, 0, rows);
    head.copy_(part);  // (any dtype: the rows may be a MoE selection)
  }
  const Tensor all = allgather_from(group, block);  // [n m, ...]
  Shape whole = part.shape();
  whole[0] = bounds.back();
  Tensor out = Tensor::empty(whole, part.dtype(), part.device());
  for (int q = 0; q < n; ++q) {
    const int64_t b0 = bounds[size_t(q)], b1 = bounds[size_t(q) + 1];
    if (b1 == b0) continue;
    Tensor dst = out.slice(0, b0, b1);
    dst.copy_(all.slice(0, int64_t(q) * m, int64_t(q) * m + (b1 - b0)));
  }
  return out;
}

Tensor reduce_scatter_rows(Comm& group, const Tensor& whole, const std::vector<int64_t>& bounds) {
  const int n = group.size(), r = group.rank();
  HLM_CHECK(int(bounds.size()) == n + 1 && bounds.front() == 0 && whole.dim() >= 1 &&
                whole.size(0) == bounds.back(),
            "reduce_scatter_rows: row bounds must hold {} offsets from 0 to the tensor's rows, got "
            "{} offsets for {}",
            n + 1, bounds.size(), whole.describe());
  int64_t m = 0;
  for (int q = 0; q < n; ++q) {
    HLM_CHECK(bounds[size_t(q)] <= bounds[size_t(q) + 1],
              "reduce_scatter_rows: row bounds must ascend");
    m = std::max(m, bounds[size_t(q) + 1] - bounds[size_t(q)]);
  }
  // Rank q's rows as block q of n blocks of m rows (zero padded), then Comm::reduce_scatter_sum:
  // each block summed over the ranks in rank order by the rank that owns it.
  const Tensor w = staged(whole, group.memory());
  Shape padded = w.shape();
  padded[0] = int64_t(n) * m;
  Tensor blocks = Tensor::zeros(padded, w.dtype(), group.memory());
  for (int q = 0; q < n; ++q) {
    const int64_t b0 = bounds[size_t(q)], b1 = bounds[size_t(q) + 1];
    if (b1 == b0) continue;
    Tensor dst = blocks.slice(0, int64_t(q) * m, int64_t(q) * m + (b1 - b0));
    dst.copy_(w.slice(0, b0, b1));
  }
  const Tensor mine = group.reduce_scatter_sum(blocks);  // [m, ...]
  const int64_t rows = bounds[size_t(r) + 1] - bounds[size_t(r)];
  return unstaged(mine.slice(0, 0, rows).contiguous(), whole.device());
}

void Comm::broadcast(Tensor& t, int root) {
  constexpr const char* what = "Comm::broadcast";
  require_on(t, memory(), what);
  HLM_CHECK(root >= 0 && root < size(), "{}: root {} is not a rank of {}", what, root, size());
  check_same(t, what);
  if (t.nbytes() > 0) broadcast_bytes(t.raw(), t.nbytes(), root);
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

int local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

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
